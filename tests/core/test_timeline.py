"""Timeline: events of every stage call, from a real fit; the file format survives kills."""

from __future__ import annotations

import json
import time

import numpy as np
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks import TimelineLogger
from rlbolt.plan import BatchPlan
from rlbolt.timeline import Timeline, append_events, read_timeline
from rlbolt.trainer import Trainer


def test_span_records_also_when_the_body_raises_and_drain_empties():
    clock = iter([1.0, 2.5, 3.0, 3.25]).__next__
    timeline = Timeline(clock=clock)
    with timeline.span("rollout", 0, samples=4, role="rollout"):
        pass
    try:
        with timeline.span("logps", 0):
            raise ValueError
    except ValueError:
        pass
    events = timeline.drain()
    assert [(e["stage"], e["start"], e["end"]) for e in events] == [("rollout", 1.0, 2.5), ("logps", 3.0, 3.25)]
    assert events[0]["samples"] == 4 and events[0]["role"] == "rollout" and events[0]["thread"]
    assert timeline.drain() == []


def test_a_torn_last_line_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    path = tmp_path / "timeline.jsonl"
    append_events(path, [{"stage": "rollout", "step": 0, "start": 0.0, "end": 1.0}])
    with open(path, "a") as f:
        f.write('{"stage": "update", "step": 0, "sta')  # a kill in the middle of a write
    assert [e["stage"] for e in read_timeline(path)] == ["rollout"]
    append_events(path, [{"stage": "update", "step": 1, "start": 2.0, "end": 3.0}])
    assert [(e["stage"], e["step"]) for e in read_timeline(path)] == [("rollout", 0), ("update", 1)]


class ScoringToy(ToyModule):
    def on_reward(self, batch):  # a reward stage, at the plan's reward micro size
        rewards = (np.asarray(batch["completion_ids"]) == self.target).mean(axis=1).astype(np.float32)
        return batch.with_columns(rewards=rewards)


class SlowUpdate(Callback):
    def on_update_start(self, trainer, state):
        time.sleep(0.15)  # a long update: async rollout of the next step runs meanwhile


def test_fit_writes_every_stage_call_and_async_rollout_overlaps_the_update(tmp_path):
    plan = BatchPlan(prompts_per_step=4, num_generations=4, mini_batch_size=8, rollout_micro_batch_size=8,
                     logps_micro_batch_size=4, reward_micro_batch_size=8)
    trainer = Trainer(plan, max_steps=4, mode="async", max_staleness=3, run_dir=tmp_path,
                      callbacks=[TimelineLogger(), SlowUpdate()])
    trainer.fit(ScoringToy(), prompt_rows(16), val_data=prompt_rows(2, seed=1))
    events = read_timeline(tmp_path / "timeline.jsonl")
    lines = (tmp_path / "timeline.jsonl").read_text().splitlines()
    assert len(lines) == len(events) and all(json.loads(line)["run"] for line in lines)
    by = lambda stage, step: [e for e in events if e["stage"] == stage and e["step"] == step]
    for step in range(4):
        # each stage's dispatches: 16 samples in rollout micro batches of 8, logps ones of 4
        assert [e["samples"] for e in by("rollout", step)] == [8, 8]
        assert [e["samples"] for e in by("logps", step)] == [4, 4, 4, 4]
        assert [e["samples"] for e in by("reward", step)] == [8, 8]
        assert max(e["end"] for e in by("reward", step)) <= min(e["start"] for e in by("advantage", step))
        assert [e["samples"] for e in by("advantage", step)] == [16]
        (update,) = by("update", step)
        assert update["role"] == "train" and update["start"] >= max(e["end"] for e in by("advantage", step))
        for e in by("rollout", step) + by("logps", step) + by("reward", step) + by("advantage", step) + [update]:
            assert e["end"] >= e["start"] and e["thread"].startswith("rlbolt-producer") == (e["stage"] != "update")
    assert len(by("validate", 3)) == 1  # after the last step
    overlaps = [k for k in range(3)
                if any(r["start"] < by("update", k)[0]["end"] and r["end"] > by("update", k)[0]["start"]
                       for r in by("rollout", k + 1))]
    assert overlaps, "no rollout of step k+1 ran during the update of step k"
    np.testing.assert_array_less(0, [e["end"] - e["start"] for e in by("update", 0)])
