"""A fit through the producer pipeline equals a fit through the single-threaded reference
(`rlbolt.producer.sequential`: the data flow's one-thread specification), bit for bit:
every trained batch, every metric outside time/ and throughput/, and the final params. Settings:
stage micro sizes that differ (so stages hand over at their own sizes), several iterations with
a logps forward, async mode running ahead, and refill rounds after dropped groups."""

from __future__ import annotations

import numpy as np
import pytest
from sequential_producer import assert_same_fit, fit_both
from toy_module import ToyModule, prompt_rows

from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


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


class ScoringToy(ToyModule):
    """Scores each sample in a reward stage (on_reward, at the plan's reward micro size); the
    reference, which predates that stage, gets the same rewards from on_advantage."""

    def on_reward(self, batch):
        rewards = (np.asarray(batch["completion_ids"]) == self.target).mean(axis=1).astype(np.float32)
        return batch.with_columns(rewards=rewards)

    def on_advantage(self, batch):
        if "rewards" not in batch:
            batch = self.on_reward(batch)
        return super().on_advantage(batch)  # recomputes the same rewards: an unchanged column


SETTINGS = {
    "sync-micro-sizes-iterations": (ToyModule, dict(
        plan=dict(mini_batch_size=8, train_micro_batch_size=4, rollout_micro_batch_size=4,
                  logps_micro_batch_size=8, num_iterations=2), trainer={})),
    "async-ahead": (ToyModule, dict(
        plan=dict(mini_batch_size=8, rollout_micro_batch_size=8, logps_micro_batch_size=4),
        trainer=dict(mode="async", max_staleness=3))),
    "reward-stage": (ScoringToy, dict(
        plan=dict(rollout_micro_batch_size=8, logps_micro_batch_size=4, reward_micro_batch_size=4), trainer={})),
    "refills": (DroppingToy, dict(
        plan=dict(rollout_micro_batch_size=4, logps_micro_batch_size=4, max_refill_rounds=6), trainer={})),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_fit_through_the_pipeline_equals_the_sequential_reference(name, monkeypatch):
    module_cls, setting = SETTINGS[name]
    plan = BatchPlan(prompts_per_step=4, num_generations=4, **setting["plan"])
    make_trainer = lambda callbacks: Trainer(plan, max_steps=5, seed=11, callbacks=callbacks, **setting["trainer"])
    run, reference = fit_both(make_trainer, module_cls, prompt_rows(40), monkeypatch)
    assert_same_fit(run, reference, lambda state: [state.params["table"]])
    if name == "refills":
        state, steps = run
        assert sum(m["refill/dropped_samples"] for m, _ in steps) > 0 and state.data_position > 5 * 4
