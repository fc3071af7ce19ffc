"""Plots and the run summary, from hand-written metrics.jsonl files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlbolt.app.cli import main
from rlbolt.app.cli_run import summarize
from rlbolt.loggers import JsonlWriter
from rlbolt.app.plotting import plot_metrics, series


def write_metrics(path: Path, rewards, *, extra=lambda step: {}) -> None:
    writer = JsonlWriter(path)
    for step, reward in enumerate(rewards, start=1):
        writer.write_scalars(step, {"reward/mean": reward, "reward/std": 0.1, "response_length/mean": 4.0,
                                    "response_length/max": 4.0, "time/rollout": 0.2, "time/update": 0.1,
                                    **extra(step)})
    writer.close()


def png_size(path: Path) -> tuple[int, int]:
    import matplotlib.image

    image = matplotlib.image.imread(path)
    return image.shape[1], image.shape[0]


def test_plots_only_topics_with_data(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [0.1, 0.2, 0.4])
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots")
    assert sorted(written) == ["response_length", "reward", "stage_times"]
    for path in written.values():
        assert path.parent == tmp_path / "plots"
        assert png_size(path) == (700, 400)  # figsize 7x4 at dpi 100


def test_kl_and_entropy_plots_when_logged(tmp_path, capsys):
    write_metrics(tmp_path / "metrics.jsonl", [0.1, 0.2], extra=lambda s: {"kl": 0.01 * s, "entropy": 2.0 - s})
    assert main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["entropy.png", "kl.png", "response_length.png", "reward.png", "stage_times.png"]
    assert "no data" not in out


def test_plot_reports_missing_topics(tmp_path, capsys):
    write_metrics(tmp_path / "metrics.jsonl", [0.5])
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "elsewhere")]) == 0
    assert "(no data for: kl, entropy)" in capsys.readouterr().out
    assert (tmp_path / "elsewhere" / "reward.png").is_file()


def test_series_skips_steps_without_the_key(tmp_path):
    records = [{"step": 1, "a": 1.0}, {"step": 2}, {"step": 3, "a": 3.5}]
    steps, values = series(records, "a")
    np.testing.assert_array_equal(steps, [1, 3])
    np.testing.assert_array_equal(values, [1.0, 3.5])


def test_unknown_topic_is_an_error(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [0.5])
    with pytest.raises(ValueError, match="unknown plot topic"):
        plot_metrics(tmp_path / "metrics.jsonl", tmp_path, topics=("loss_landscape",))


def test_summary_condenses_the_reward_curve(tmp_path):
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.95, 0.7, 0.92, 0.99]
    write_metrics(tmp_path / "metrics.jsonl", rewards)
    summary = summarize(tmp_path, steps=11, seconds=90.0, target=0.9)
    # float64 Python arithmetic on both sides (approx's default rel 1e-6 is ~1e10 ulps of float64)
    assert summary.start_reward == pytest.approx(rewards[0])
    assert summary.end_reward == pytest.approx(np.mean(rewards[-5:]))
    assert summary.first_step_at_target == 8  # 0.95 is the 8th step
    assert (tmp_path / "plots" / "reward.png").is_file()
    text = summary.text()
    assert "11 steps in 1.5 min" in text and "first reached 0.9 at step 8" in text


def test_summary_start_survives_a_resume_and_names_no_target_unless_asked(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [0.25, 0.5])
    before = summarize(tmp_path, steps=2, seconds=1.0)
    write_metrics(tmp_path / "metrics.jsonl", [0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95])  # the resumed run's file
    after = summarize(tmp_path, steps=7, seconds=1.0)
    assert before.start_reward == after.start_reward == 0.25
    # A fit run has no target level: its summary must not claim one was missed.
    assert "reach" not in after.text() and "0.250 at the start" in after.text()
    assert "did not reach 0.99" in summarize(tmp_path, steps=7, seconds=1.0, target=0.99).text()
