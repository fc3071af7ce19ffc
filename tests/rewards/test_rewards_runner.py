"""RewardRunner: failure isolation, time-outs that bound the call, metrics, both executors."""

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from rlbolt.rewards import RewardRunner, WeightedReward



@pytest.fixture(autouse=True)
def _importable_from_spawned_workers(monkeypatch):
    # pytest imports this file as `tests.rewards.test_rewards_runner` without putting the repo
    # root on sys.path; spawned workers unpickle the rewards below by that name, so add it.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))


# Module-level so the "process" executor can pickle them into spawned workers.


def flaky_reward(completion, sample):
    """Raises for sample 1, hangs for sample 3, otherwise scores the completion's length."""
    if sample["id"] == 1:
        raise RuntimeError("boom on sample one")
    if sample["id"] == 3:
        time.sleep(60)
    return float(len(completion))


def parity_reward(completion, sample):
    return 1.0 if sample["id"] % 2 == 0 else 0.0


def worker_pid_reward(completion, sample):
    return float(os.getpid())


def crashing_reward(completion, sample):
    if sample["id"] == 0:
        os._exit(3)  # simulates a segfault in a native extension
    return 1.0


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_raise_and_hang_get_the_penalty_and_the_call_stays_bounded(executor, caplog):
    completions = ["a", "bb", "ccc", "dddd", "eeeee"]
    samples = [{"id": i} for i in range(5)]
    with RewardRunner(flaky_reward, timeout_s=1.0, penalty=-1.0, max_workers=4, executor=executor) as runner:
        # Start the process workers before timing, so only the scoring is measured.
        runner.score(["x"] * 4, [{"id": 0}] * 4)
        caplog.set_level(logging.WARNING, logger="rlbolt.rewards.runner")
        started = time.monotonic()
        result = runner.score(completions, samples)
        elapsed = time.monotonic() - started
        # A bound, not a benchmark: one sample never returns, yet the call ends near timeout_s.
        assert elapsed < 10.0
        np.testing.assert_array_equal(result.rewards, np.array([1, -1, 3, -1, 5], np.float32))
        assert result.rewards.dtype == np.float32
        assert result.metrics["reward/failures"] == 1.0
        assert result.metrics["reward/timeouts"] == 1.0
        assert result.metrics["reward/failures"] + result.metrics["reward/timeouts"] == 2.0
        # float64 means of a few floats on both sides: approx's 1e-6 relative is ~1e10 float64 ulps
        assert result.metrics["reward/mean"] == pytest.approx(np.mean([1, -1, 3, -1, 5]))
        assert result.metrics["reward/std"] == pytest.approx(np.std([1, -1, 3, -1, 5]))
        per_fn = result.per_fn["flaky"]
        np.testing.assert_array_equal(np.isnan(per_fn), [False, True, False, True, False])
        assert result.metrics["reward/flaky/mean"] == pytest.approx(3.0)
        assert set(result.errors) == {1, 3}
        assert "boom on sample one" in result.errors[1]
        assert "TimeoutError" in result.errors[3]
        assert any("boom on sample one" in record.getMessage() for record in caplog.records)
        # The runner stays usable after a timeout: the next call gets a fresh worker.
        again = runner.score(["zz"], [{"id": 0}])
        np.testing.assert_array_equal(again.rewards, [2.0])


def test_identical_failures_are_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="rlbolt.rewards.runner")
    with RewardRunner(flaky_reward, timeout_s=5.0, max_workers=2, max_failed_batches=0) as runner:
        for _ in range(3):
            runner.score(["a", "b"], [{"id": 1}, {"id": 1}])
    messages = [r.getMessage() for r in caplog.records if "boom on sample one" in r.getMessage()]
    assert len(messages) == 1


def test_weighted_reward_metrics_by_hand():
    reward = WeightedReward([("parity", parity_reward, 2.0), ("flaky", flaky_reward, 0.5)])
    completions = ["ab", "abc", "abcd", "abcde"]
    samples = [{"id": 0}, {"id": 1}, {"id": 2}, {"id": 4}]
    with RewardRunner(reward, timeout_s=5.0, penalty=0.0, max_workers=3) as runner:
        result = runner.score(completions, samples)
    # id 1 raises inside "flaky", so the whole sample gets the penalty (0.0).
    expected = [2.0 * 1 + 0.5 * 2, 0.0, 2.0 * 1 + 0.5 * 4, 2.0 * 1 + 0.5 * 5]
    # float64 rewards, the same arithmetic: allclose's default rtol 1e-7 is ~1e9 float64 ulps
    np.testing.assert_allclose(result.rewards, expected)
    assert result.metrics["reward/parity/mean"] == pytest.approx(1.0)  # over the 3 scored samples
    assert result.metrics["reward/flaky/mean"] == pytest.approx((2 + 4 + 5) / 3)
    assert result.metrics["reward/failures"] == 1.0 and result.metrics["reward/timeouts"] == 0.0
    assert result.metrics["reward/mean"] == pytest.approx(np.mean(expected))


def test_non_finite_rewards_are_failures():
    with RewardRunner(lambda c, s: float("nan") if s["id"] else 1.0, penalty=-2.0) as runner:
        result = runner.score(["a", "b"], [{"id": 0}, {"id": 1}])
    np.testing.assert_array_equal(result.rewards, [1.0, -2.0])
    assert "finite" in result.errors[1]
    assert "reward/lambda/mean" in result.metrics


def test_process_executor_reuses_workers_and_survives_a_crash():
    with RewardRunner(worker_pid_reward, executor="process", max_workers=1) as runner:
        first = runner.score(["a", "b"], [{"id": 0}, {"id": 1}]).rewards
        second = runner.score(["a"], [{"id": 0}]).rewards
        assert first[0] == first[1] == second[0] != os.getpid()  # one worker kept across calls
    with RewardRunner(crashing_reward, executor="process", max_workers=2, penalty=-1.0) as runner:
        result = runner.score(["a", "b", "c"], [{"id": 0}, {"id": 1}, {"id": 2}])
        np.testing.assert_array_equal(result.rewards, [-1.0, 1.0, 1.0])
        assert "exit code 3" in result.errors[0]


def test_empty_batch_and_bad_arguments():
    with RewardRunner(parity_reward) as runner:
        result = runner.score([], [])
        assert result.rewards.shape == (0,) and result.metrics["reward/failures"] == 0.0
        with pytest.raises(ValueError, match="2 completions but 1 samples"):
            runner.score(["a", "b"], [{"id": 0}])
    with pytest.raises(ValueError, match="executor"):
        RewardRunner(parity_reward, executor="fork")
    with pytest.raises(TypeError, match="picklable"):
        RewardRunner(lambda c, s: 1.0, executor="process")
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(parity_reward, timeout_s=0)


@pytest.mark.slow  # the runner's hostile cases above stay in the default tier; this is the whole fit around them
def test_a_fit_survives_hostile_rewards_and_stops_on_one_that_always_fails(tmp_path, caplog):
    """Steps 1-3: os._exit, a GIL-holding regex, a hang, a string and a NaN reward cost only their
    samples, with the worker pool bounded. Then the reward raises for every sample (issue 15: that
    used to give one warning and a whole run of reward, loss and grad_norm 0, exit 0); after
    reward.max_failed_batches such steps the run stops with an error naming it."""
    from hostile_rewards import staged_reward

    from rlbolt.callback import Callback
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.rewards import RewardFailureError
    from rlbolt.trainer import Trainer

    class Steps(Callback):
        def __init__(self):
            self.metrics, self.live = [], []

        def on_step_end(self, trainer, info):
            self.metrics.append(info.metrics)
            self.live.append(trainer.module.reward_runner.live_workers())

    tiny = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32)
    module = GRPO({"model": {"tiny": tiny}, "rollout": {"max_new_tokens": 4}, "data": {"max_prompt_tokens": 16},
                   "reward": {"max_failed_batches": 2, "timeout_s": 1.0}}, reward=staged_reward)
    steps = Steps()
    trainer = Trainer(BatchPlan(prompts_per_step=3, num_generations=2), max_steps=8, run_dir=tmp_path,
                      callbacks=[steps])
    caplog.set_level(logging.WARNING, logger="rlbolt.rewards.runner")
    with pytest.raises(RewardFailureError, match=r"2 consecutive batches \(reward.max_failed_batches=2\).*"
                                                 r"reward 'staged' raised RuntimeError: the grader is down"):
        trainer.fit(module, gsm8k_style_rows(30))
    assert module.reward_runner.executor == "process"
    first, second, third, fourth = steps.metrics  # step 5's rewards stopped the run
    # Each prompt's 2 samples: exit failed, regex timed out, the third scored.
    assert (first["reward/failures"], first["reward/timeouts"]) == (2.0, 2.0) and first["reward/staged/mean"] > 0
    # hang timed out, the string failed, the third scored; then NaN failed and two scored.
    assert (second["reward/failures"], second["reward/timeouts"]) == (2.0, 2.0) and second["reward/staged/mean"] > 0
    assert (third["reward/failures"], third["reward/timeouts"]) == (2.0, 0.0) and third["reward/staged/mean"] > 0
    assert fourth["reward/failures"] == 6.0 and fourth["loss"] == 0.0
    assert max(steps.live) <= module.config.reward.max_workers
    assert sum("the grader is down" in r.getMessage() for r in caplog.records) == 1
