"""A fit through the producer pipeline equals a fit through the single-threaded reference
(tests/sequential_producer.py: the producer rlbolt had before the ExperienceDock), bit for bit:
every trained batch, every metric outside time/ and throughput/, and the final params. Settings:
stage micro sizes that differ (so stages hand over at their own sizes), several iterations with
a logps forward, async mode running ahead, and refill rounds after dropped groups."""

from __future__ import annotations

import numpy as np
import pytest
from sequential_producer import SequentialProducer
from toy_module import ToyModule, prompt_rows

import rlbolt.trainer
from rlbolt.callback import Callback
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

TIMING_PREFIXES = ("time/", "throughput/")


class DroppingToy(ToyModule):
    """Drops groups whose rewards all tie (DAPO's dynamic sampling), so the producer refills."""

    def __init__(self):
        super().__init__(completion_len=2)  # short completions: ties are frequent

    def on_advantage(self, batch):
        out = super().on_advantage(batch)
        rewards, groups = np.asarray(out["rewards"]), np.asarray(out["group_ids"])
        keep = np.array([np.ptp(rewards[groups == g]) > 0 for g in groups])
        self.log("toy/kept_fraction", float(keep.mean()))
        return out.select(keep)


class Capture(Callback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, info):
        self.steps.append((dict(info.metrics), info.batch))


SETTINGS = {
    "sync-micro-sizes-iterations": (ToyModule, dict(
        plan=dict(mini_batch_size=8, train_micro_batch_size=4, rollout_micro_batch_size=4,
                  logps_micro_batch_size=8, num_iterations=2), trainer={})),
    "async-ahead": (ToyModule, dict(
        plan=dict(mini_batch_size=8, rollout_micro_batch_size=8, logps_micro_batch_size=4),
        trainer=dict(mode="async", max_staleness=3))),
    "refills": (DroppingToy, dict(
        plan=dict(rollout_micro_batch_size=4, logps_micro_batch_size=4, max_refill_rounds=6), trainer={})),
}


def fit(module_cls, setting, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(rlbolt.trainer, "Producer", SequentialProducer)
    capture = Capture()
    plan = BatchPlan(prompts_per_step=4, num_generations=4, **setting["plan"])
    trainer = Trainer(plan, max_steps=5, seed=11, callbacks=[capture], **setting["trainer"])
    state = trainer.fit(module_cls(), prompt_rows(40))
    if monkeypatch is not None:
        monkeypatch.undo()
    return state, capture.steps


@pytest.mark.parametrize("name", SETTINGS)
def test_fit_through_the_pipeline_equals_the_sequential_reference(name, monkeypatch):
    module_cls, setting = SETTINGS[name]
    state, steps = fit(module_cls, setting)
    ref_state, ref_steps = fit(module_cls, setting, monkeypatch)
    assert len(steps) == len(ref_steps) == 5
    for s, ((metrics, batch), (ref_metrics, ref_batch)) in enumerate(zip(steps, ref_steps)):
        keys = {k for k in metrics if not k.startswith(TIMING_PREFIXES)}
        assert keys == {k for k in ref_metrics if not k.startswith(TIMING_PREFIXES)}, f"step {s}: metric names"
        for k in keys:
            assert metrics[k] == ref_metrics[k], f"step {s}: {k} = {metrics[k]!r}, reference {ref_metrics[k]!r}"
        assert sorted(batch) == sorted(ref_batch)
        for col in batch:
            a, b = np.asarray(batch[col]), np.asarray(ref_batch[col])
            assert a.dtype == b.dtype and a.shape == b.shape, f"step {s}: column {col}"
            assert (a == b).all(), f"step {s}: column {col} differs"
    np.testing.assert_array_equal(state.params["table"], ref_state.params["table"])
    assert state.params["table"].tobytes() == ref_state.params["table"].tobytes()
    assert (state.step, state.policy_version, state.data_position) == (
        ref_state.step, ref_state.policy_version, ref_state.data_position)
    if name == "refills":
        dropped = [m["refill/dropped_samples"] for m, _ in steps]
        assert sum(dropped) > 0 and state.data_position > 5 * 4  # refill rounds happened
