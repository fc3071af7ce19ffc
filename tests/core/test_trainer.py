import random
import threading
import time
import traceback

import jax
import numpy as np
import optax
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


class Record(Callback):
    def __init__(self):
        self.infos, self.produced = [], []

    def on_rollout_end(self, trainer, rollout):
        self.produced.append(rollout)

    def on_step_end(self, trainer, info):
        self.infos.append(info)


def _producers_alive():
    return [t for t in threading.enumerate() if t.name.startswith("rlbolt-producer") and t.is_alive()]


def _plan(**kw):
    return BatchPlan(**{"prompts_per_step": 4, "num_generations": 4, **kw})


def test_toy_policy_learns_through_fit():
    rec = Record()
    Trainer(_plan(mini_batch_size=8), max_steps=30, callbacks=[rec]).fit(ToyModule(), prompt_rows(16))
    rewards = [i.metrics["reward/mean"] for i in rec.infos]
    assert np.mean(rewards[:5]) < 0.3  # chance is 1/8 per token
    assert np.mean(rewards[-5:]) > 0.7
    assert rec.infos[-1].metrics["toy/logged"] > 0  # RLModule.log from the producer thread reaches the step


def _accumulation_run(train_micro):
    module = ToyModule(optimizer=optax.sgd(0.5))
    plan = _plan(mini_batch_size=8, train_micro_batch_size=train_micro)
    return Trainer(plan, max_steps=3).fit(module, prompt_rows(16))


@pytest.fixture(scope="module")
def full_mini_batch_run():
    """The run without accumulation, the reference of every micro batch size (the same run each time)."""
    return _accumulation_run(8)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_gradient_accumulation_equals_full_mini_batch_update(micro, full_mini_batch_run):
    full, accumulated = full_mini_batch_run, _accumulation_run(micro)
    assert accumulated.policy_version == full.policy_version == 6
    # Same rollouts (per-sample keys), same update up to float32 summation order.
    # the toy table's gradient sums <= 8 rows: <= 8 * eps relative per step (sum_error_bound), 3 steps: rtol=1e-5
    np.testing.assert_allclose(accumulated.params["table"], full.params["table"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(full.params["table"], ToyModule().init_params(jax.random.fold_in(jax.random.PRNGKey(0), 0))["table"])


def test_iterations_mini_batches_versions_and_staleness(monkeypatch, tmp_path):
    monkeypatch.setenv("RLBOLT_STEP_FILE", str(tmp_path / "step"))  # as `rlbolt launch` sets it (step_beacon)
    rec = Record()
    state = Trainer(_plan(mini_batch_size=8, num_iterations=2), max_steps=3, callbacks=[rec]).fit(ToyModule(), prompt_rows(16))
    assert state.policy_version == 3 * 2 * 2  # steps x iterations x mini batches
    for info, produced in zip(rec.infos, rec.produced):
        assert set(np.asarray(produced.batch["policy_version"]).tolist()) == {produced.policy_version}
        assert info.metrics["staleness/max"] == 3  # the 4th update of a step trains on version v samples
    assert [p.policy_version for p in rec.produced] == [0, 4, 8]
    assert (tmp_path / "step").read_text() == "step 3"  # the last completed step, for the launcher's line


def test_max_epochs_visits_every_prompt_once_per_epoch_across_boundaries():
    rec = Record()
    # 10 prompts, 4 per step: steps straddle epoch boundaries; 3 epochs = 30 prompts -> 7 full steps.
    state = Trainer(_plan(), max_epochs=3, callbacks=[rec]).fit(ToyModule(), prompt_rows(10))
    assert state.step == 7 and state.data_position == 28
    seen = np.concatenate([np.asarray(p.batch["prompt_index"])[::4] for p in rec.produced])
    assert seen.tolist() == list(range(28))
    first_epoch = [rec.produced[0].batch["prompt"][0]]
    # a float64 ratio of sample counts (14 / 5): approx for form only
    assert rec.infos[-1].epoch == pytest.approx(2.8)
    assert first_epoch  # prompts are real rows


def test_keyboard_interrupt_is_a_clean_stop():
    seen = []

    class Interrupt(Callback):
        def on_step_end(self, trainer, info):
            if info.step == 3:
                raise KeyboardInterrupt

        def on_exception(self, trainer, exc):
            seen.append(type(exc))

    trainer = Trainer(_plan(), max_steps=50, callbacks=[Interrupt()])
    state = trainer.fit(ToyModule(), prompt_rows(16))
    assert trainer.interrupted and seen == [KeyboardInterrupt]
    assert state.step == 3
    assert not _producers_alive()


class FailingAdvantage(ToyModule):
    def on_advantage(self, batch):
        if int(batch["prompt_index"][0]) >= 8:  # the third step's prompts
            raise ZeroDivisionError("reward blew up")
        return super().on_advantage(batch)


def test_producer_exception_is_raised_by_fit_with_its_frames():
    seen = []

    class Watch(Callback):
        def on_exception(self, trainer, exc):
            seen.append(exc)

    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="reward blew up") as info:
        Trainer(_plan(), max_steps=10, callbacks=[Watch()]).fit(FailingAdvantage(), prompt_rows(16))
    assert time.monotonic() - start < 30  # includes compiling; the failure itself is immediate
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "on_advantage" in frames and "_advantage" in frames  # the advantage stage's own frames
    assert any("rlbolt-producer-advantage" in n for n in info.value.__notes__)
    assert seen and seen[0] is info.value
    assert not _producers_alive()


def test_consumer_exception_stops_producer():
    class Boom(Callback):
        def on_step_end(self, trainer, info):
            raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        Trainer(_plan(), max_steps=10).fit(ToyModule(), prompt_rows(16)) if False else \
            Trainer(_plan(), max_steps=10, callbacks=[Boom()]).fit(ToyModule(), prompt_rows(16))
    assert not _producers_alive()


class JitteryModule(ToyModule):
    def __init__(self, seed):
        super().__init__()
        self.rng = random.Random(seed)

    def on_rollout(self, params, batch):
        time.sleep(self.rng.random() * 0.03)
        return super().on_rollout(params, batch)


@pytest.mark.parametrize("seed", [0, 1])
def test_async_mode_never_trains_staler_than_max_staleness(seed):
    rng = random.Random(seed + 100)
    max_staleness = 5  # 2 updates per step -> the producer may run 2 steps ahead

    class Check(Callback):
        def __init__(self):
            self.staleness, self.ahead = [], []

        def on_step_start(self, trainer, step):
            self.version_at_start = trainer.last_state.policy_version

        def on_rollout_end(self, trainer, rollout):
            versions = np.asarray(rollout.batch["policy_version"])
            last_update_version = self.version_at_start + trainer.plan.updates_per_step - 1
            self.staleness.append(int(last_update_version - versions.min()))
            self.ahead.append(rollout.step - rollout.weights_step)

        def on_step_end(self, trainer, info):
            time.sleep(rng.random() * 0.03)

    check = Check()
    trainer = Trainer(_plan(mini_batch_size=8), max_steps=12, mode="async", max_staleness=max_staleness, callbacks=[check])
    trainer.fit(JitteryModule(seed), prompt_rows(16))
    assert trainer.lag_steps == 2
    assert max(check.staleness) == max_staleness  # the bound holds and is reached
    assert max(check.ahead) == 2  # step s rolled out with the weights after s - 2 steps


def test_async_needs_a_staleness_that_allows_running_ahead():
    with pytest.raises(ValueError, match="max_staleness >= 3"):
        Trainer(_plan(mini_batch_size=8), mode="async", max_staleness=2)
    with pytest.raises(ValueError, match="only used with mode='async'"):
        Trainer(_plan(), max_staleness=3)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_runs_are_deterministic(mode):
    kwargs = {"mode": "async", "max_staleness": 1} if mode == "async" else {}

    def run():
        return Trainer(_plan(), max_steps=6, seed=3, **kwargs).fit(JitteryModule(0), prompt_rows(16)).params["table"]

    np.testing.assert_array_equal(run(), run())


def test_bad_trainer_arguments():
    with pytest.raises(ValueError, match="max_steps=0"):
        Trainer(_plan(), max_steps=0)
    with pytest.raises(ValueError, match="mode='fast'"):
        Trainer(_plan(), mode="fast")
    with pytest.raises(ValueError, match="fewer than prompts_per_step=4"):
        Trainer(_plan(), max_epochs=1).fit(ToyModule(), prompt_rows(3))


@pytest.mark.parametrize("kwargs, validated", [
    ({"max_steps": 5, "val_every_n_steps": 2, "val_at_start": True}, [0, 2, 4, 5]),  # 5: the last step
    ({"max_steps": 4, "val_every_n_steps": 2}, [2, 4]),  # 4 was just validated: not twice
    ({"max_steps": 3}, [3]),  # val_data alone: after the last step only
])
def test_fit_validation_schedule_by_hand(kwargs, validated):
    """fit(val_data=...)'s Evaluation validates at step 0 (val_at_start), every val_every_n_steps,
    and after the last step unless that step was just validated."""
    class Steps(Callback):
        def __init__(self):
            self.steps = []

        def on_validation_end(self, run, step, metrics):
            self.steps.append(step)

    seen = Steps()
    Trainer(BatchPlan(prompts_per_step=2, num_generations=2), callbacks=[seen], **kwargs).fit(
        ToyModule(), prompt_rows(12), val_data=prompt_rows(2, seed=1))
    assert seen.steps == validated
