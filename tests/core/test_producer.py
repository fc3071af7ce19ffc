"""The producer pipeline's own rules: stages hand over at their own sizes (the service batch
falls out), a refill round honours the micro sizes, hooks may only add columns, and the dock's
per-stage counters reach the step metrics."""

from __future__ import annotations

import time

import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


class Metrics(Callback):
    def __init__(self):
        self.metrics = []

    def on_step_end(self, trainer, info):
        self.metrics.append(info.metrics)


class SlowRollout(ToyModule):
    def on_rollout(self, params, batch):
        time.sleep(0.05)
        return super().on_rollout(params, batch)


def test_logps_start_before_the_step_is_rolled_out_and_counters_reach_the_metrics():
    plan = BatchPlan(prompts_per_step=4, num_generations=4, rollout_micro_batch_size=4, logps_micro_batch_size=8)
    metrics = Metrics()
    trainer = Trainer(plan, max_steps=2, callbacks=[metrics])
    trainer.fit(SlowRollout(), prompt_rows(16))
    events = trainer.timeline.drain()
    for step in range(2):
        rollouts = [e for e in events if e["stage"] == "rollout" and e["step"] == step]
        logps = [e for e in events if e["stage"] == "logps" and e["step"] == step]
        assert [e["samples"] for e in rollouts] == [4, 4, 4, 4] and [e["samples"] for e in logps] == [8, 8]
        # the first logps call needs the first two rollout calls (lcm 8), not the whole step
        assert rollouts[1]["end"] <= logps[0]["start"] < rollouts[3]["end"]
    for m in metrics.metrics:
        for stage in ("rollout", "logps", "advantage", "train"):
            assert m[f"time/dock_wait/{stage}"] >= 0 and m[f"time/dock_waits/{stage}"] >= 0
        assert m["throughput/dock/rollout/samples_per_s"] > 0
        assert m["time/dock_waits/logps"] >= 1  # logps waited for rollouts at least once a step


class DropFirstGroups(ToyModule):
    """Round 0 keeps one group of four; the refill round (12 samples) is then larger than the
    rollout micro size 8 and not a multiple of it."""

    def on_advantage(self, batch):
        out = super().on_advantage(batch)
        groups = np.asarray(out["group_ids"])
        return out.select(groups == groups[0]) if groups.min() < 4 else out


def test_a_refill_round_runs_in_micro_batches_and_a_short_last_one():
    plan = BatchPlan(prompts_per_step=4, num_generations=4, rollout_micro_batch_size=8, logps_micro_batch_size=8,
                     max_refill_rounds=2)
    trainer = Trainer(plan, max_steps=1, shuffle=False)
    state = trainer.fit(DropFirstGroups(), prompt_rows(16))
    events = trainer.timeline.drain()
    assert [e["samples"] for e in events if e["stage"] == "rollout"] == [8, 8, 8, 4]  # round 0, then 12 as 8 + 4
    assert [e["samples"] for e in events if e["stage"] == "advantage"] == [16, 12]
    assert state.data_position == 7  # 4 prompts, then 3 more to refill the dropped group


class RewritesColumn(ToyModule):
    def compute_logps(self, params, batch):
        out = super().compute_logps(params, batch)
        return out.with_columns(completion_ids=np.asarray(out["completion_ids"]) + 1)


class ReordersSamples(ToyModule):
    def on_advantage(self, batch):
        return super().on_advantage(batch).select(np.arange(batch.num_samples)[::-1])


class DropsSamplesInRollout(ToyModule):
    def on_rollout(self, params, batch):
        return super().on_rollout(params, batch).slice(0, 2)


class RewardWithoutRewards(ToyModule):
    def on_reward(self, batch):
        return batch.with_columns(score=np.zeros(batch.num_samples, np.float32))


@pytest.mark.parametrize("module_cls, message", [
    (RewritesColumn, "compute_logps changed column 'completion_ids', which an earlier stage wrote"),
    (ReordersSamples, "not a subset of its input in input order"),
    (DropsSamplesInRollout, "on_rollout returned 2 samples for 4; it must return one row per sample"),
    (RewardWithoutRewards, r"on_reward must add a `rewards` column of shape \[4\]; got none"),
])
def test_a_hook_that_breaks_the_column_contract_fails_with_one_line(module_cls, message):
    plan = BatchPlan(prompts_per_step=2, num_generations=2, rollout_micro_batch_size=4, reward_micro_batch_size=4)
    with pytest.raises(ValueError, match=message):
        Trainer(plan, max_steps=1).fit(module_cls(), prompt_rows(4))


class StuckRollout(ToyModule):
    def on_rollout(self, params, batch):
        time.sleep(1.5)
        return super().on_rollout(params, batch)


def test_prefetch_timeout_ends_a_stuck_producer():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no step from the producer for 0.3 s \(prefetch_timeout_s\)"):
        Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=2, prefetch_timeout_s=0.3).fit(
            StuckRollout(), prompt_rows(4))
    assert time.monotonic() - start < 10  # the stuck hook finished and its thread was joined


def test_should_stop_ends_the_wait_for_a_step_at_once():
    import threading

    import jax

    from rlbolt.data.source import PromptSource
    from rlbolt.producer import Producer
    from rlbolt.producer.weights import WeightStore

    module = StuckRollout()
    plan = BatchPlan(prompts_per_step=2, num_generations=2)
    weights = WeightStore(0)
    weights.publish(0, module.init_params(jax.random.key(0)), 0)
    producer = Producer(module, plan, PromptSource(prompt_rows(4)), weights, jax.random.key(1),
                        max_steps=2, max_prompts=None)
    stop = threading.Event()
    with producer.start(0, 0, should_stop=stop.is_set) as steps:
        threading.Timer(0.2, stop.set).start()
        start = time.monotonic()
        assert list(steps) == []  # the rollout is still sleeping: no step, and no waiting for one
        assert time.monotonic() - start < 1.0
