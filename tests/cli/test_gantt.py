"""The Gantt chart of timeline.jsonl, from hand-written events."""

from __future__ import annotations

import pytest

from rlbolt.app.cli import main
from rlbolt.app.gantt import busy_seconds, plot_timeline, select_events
from rlbolt.loggers import JsonlWriter
from rlbolt.timeline import append_events


def ev(stage, step, start, end, run=1.0):
    return {"stage": stage, "step": step, "start": start, "end": end, "run": run}


def test_busy_seconds_counts_overlapping_calls_once():
    events = [ev("r", 0, 0.0, 2.0), ev("r", 0, 1.0, 3.0), ev("r", 1, 5.0, 6.0), ev("r", 1, 5.5, 5.75)]
    assert busy_seconds(events) == pytest.approx(4.0)  # [0, 3] and [5, 6]; float64 sums of small integers
    assert busy_seconds([]) == 0.0


def test_only_the_newest_run_and_its_last_steps_are_drawn():
    killed = [ev("update", s, s, s + 0.5, run=1.0) for s in range(4)]
    resumed = [ev("update", s, 10 + s, 10.5 + s, run=2.0) for s in range(2, 8)]
    picked = select_events(killed + resumed, last_steps=3)
    assert [(e["step"], e["run"]) for e in picked] == [(5, 2.0), (6, 2.0), (7, 2.0)]
    assert len(select_events(killed + resumed, last_steps=None)) == 6


def pipeline_events(steps=4):
    out, t = [], 0.0
    for s in range(steps):
        out += [ev("rollout", s, t, t + 1.0), ev("rollout", s, t + 1.0, t + 2.0), ev("logps", s, t + 1.0, t + 1.4),
                ev("logps", s, t + 2.0, t + 2.4), ev("advantage", s, t + 2.4, t + 2.6), ev("update", s, t + 2.6, t + 4.0)]
        t += 2.0  # the next step's rollout overlaps this step's update
    return out


def test_plot_timeline_writes_a_png_with_a_row_per_stage(tmp_path):
    import matplotlib.image

    append_events(tmp_path / "timeline.jsonl", pipeline_events())
    path = plot_timeline(tmp_path / "timeline.jsonl", tmp_path / "plots" / "timeline.png")
    image = matplotlib.image.imread(path)
    assert (image.shape[1], image.shape[0]) == (1100, int(100 * (1.2 + 0.7 * 4)))  # 4 stage rows
    (tmp_path / "empty.jsonl").write_text("")
    assert plot_timeline(tmp_path / "empty.jsonl", tmp_path / "x.png") is None


def test_rlbolt_plot_draws_the_timeline_when_the_run_has_one(tmp_path, capsys):
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    writer.write_scalars(1, {"reward/mean": 0.5})
    writer.close()
    assert main(["plot", str(tmp_path)]) == 0
    assert "timeline.png" not in capsys.readouterr().out
    append_events(tmp_path / "timeline.jsonl", pipeline_events(2))
    assert main(["plot", str(tmp_path)]) == 0
    assert str(tmp_path / "plots" / "timeline.png") in capsys.readouterr().out
    assert (tmp_path / "plots" / "timeline.png").is_file()
