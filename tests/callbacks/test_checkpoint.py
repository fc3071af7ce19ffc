"""ModelCheckpoint: what it saves, when, what it keeps, and how it restores (in-process).

Most tests drive the hooks with a stand-in trainer (no compile); two fit the toy module for
real: an exact in-process resume, and a corrupt latest checkpoint falling back to the previous.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback, CallbackList
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.checkpointing.io import CheckpointIO
from rlbolt.plan import BatchPlan
from rlbolt.state import StepInfo, TrainState
from rlbolt.trainer import Trainer
from fake_fit import FakeFit

TX = optax.adam(0.1)


def make_state(step: int, value: float = 0.0) -> TrainState:
    params = {"w": jnp.full((3, 2), value, jnp.float32), "b": jnp.arange(2, dtype=jnp.int32) + step}
    opt_state = TX.init(params)
    return TrainState(step=step, params=params, opt_state=opt_state, rng=jnp.array([7, step], jnp.uint32),
                      policy_version=2 * step, data_position=4 * step)


class Counter(Callback):
    def __init__(self):
        self.count = 0

    def on_step_end(self, trainer, info):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def fake_trainer(tmp_path: Path, callbacks, lag: int = 0, mode: str = "sync"):
    """The few Trainer attributes ModelCheckpoint reads."""
    return FakeFit(tmp_path, callbacks, lag=lag, mode=mode)


def run_steps(trainer, ckpt: ModelCheckpoint, steps, val=None) -> None:
    """Calls the hooks as fit would for `steps` (values are the params' fill value)."""
    for step in steps:
        state = make_state(step, float(step))
        trainer.callbacks.on_step_end(trainer.run, StepInfo(step, state, {"loss": 0.0}, 0.0))
        if val is not None:
            trainer.callbacks.on_validation_end(trainer.run, step, {"val/accuracy": val[step]})
        trainer.weights.publish(step, state.params, state.policy_version)
        trainer.last_state = state


def test_keeps_newest_k_plus_best_by_metric(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=1, keep=2, best_metric="val/accuracy", async_save=True)
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    accuracy = {1: 0.1, 2: 0.9, 3: 0.3, 4: 0.2, 5: 0.5, 6: 0.4}
    run_steps(trainer, ckpt, range(1, 7), val=accuracy)
    ckpt.on_fit_end(trainer.run, trainer.last_state)
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [2, 5, 6]
    assert (tmp_path / "checkpoints" / "best.json").exists()
    assert ckpt._best == {"metric": "val/accuracy", "mode": "max", "step": 2, "value": 0.9}


def test_best_step_is_saved_even_between_periodic_saves(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=3, keep=1, best_metric="val/loss", best_mode="min", async_save=False)
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    run_steps(trainer, ckpt, range(1, 5), val=None)
    trainer.callbacks.on_validation_end(trainer.run, 4, {"val/loss": 0.5})  # step 4: not a periodic step
    ckpt.on_fit_end(trainer.run, trainer.last_state)
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [4]  # newest is also the best; 3 pruned


def test_every_secs_with_injected_clock(tmp_path):
    now = [0.0]
    ckpt = ModelCheckpoint(every_secs=10.0, keep=None, async_save=False, clock=lambda: now[0])
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    for step, t in zip(range(1, 6), (4.0, 11.0, 15.0, 20.0, 32.0)):
        now[0] = t
        run_steps(trainer, ckpt, [step])
    ckpt.finish()
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [2, 5]  # t=11 (11 s since 0), t=32 (21 s since 11)


def test_restore_roundtrip_state_callbacks_and_retained_weights(tmp_path):
    counter = Counter()
    ckpt = ModelCheckpoint(every_n_steps=5, async_save=True)
    trainer = fake_trainer(tmp_path, [counter, ckpt], lag=2, mode="async")
    trainer.restore_with(ckpt, make_state(0))
    trainer.weights.publish(0, make_state(0).params, 0)
    run_steps(trainer, ckpt, range(1, 6))
    ckpt.finish()
    saved = make_state(5, 5.0)

    counter2 = Counter()
    ckpt2 = ModelCheckpoint()
    trainer2 = fake_trainer(tmp_path, [counter2, ckpt2], lag=2, mode="async")
    restored = trainer2.restore_with(trainer2.callbacks, make_state(0))
    assert ckpt2.restored_step == 5 and counter2.count == 5
    assert (restored.step, restored.policy_version, restored.data_position) == (5, 10, 20)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    retained = trainer2.weights.retained()
    assert sorted(retained) == [3, 4]  # what the producer of steps 5 and 6 will ask for
    for k in (3, 4):
        params, version = retained[k]
        assert version == 2 * k and np.array_equal(params["w"], np.full((3, 2), float(k), np.float32))


def test_resume_errors_name_the_fix(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=1, async_save=False)
    trainer = fake_trainer(tmp_path, [ckpt], lag=1, mode="async")
    trainer.restore_with(ckpt, make_state(0))
    run_steps(trainer, ckpt, [1, 2])
    ckpt.finish()
    with pytest.raises(ValueError, match=r"resume=None.*resume='latest'"):
        fake_trainer(tmp_path, []).restore_with(ModelCheckpoint(resume=None), make_state(0))
    with pytest.raises(ValueError, match=r"resume=7.*available steps: \[1, 2\]"):
        fake_trainer(tmp_path, []).restore_with(ModelCheckpoint(resume=7), make_state(0))
    with pytest.raises(ValueError, match=r"trainer.mode: 'async' -> 'sync'; .*--allow-config-change"):
        fake_trainer(tmp_path, [], lag=0, mode="sync").restore_with(ModelCheckpoint(), make_state(0))
    # Even when config changes are allowed, the producer's lag must match for an exact resume.
    with pytest.raises(ValueError, match="mode='async'.*mode='sync'"):
        fake_trainer(tmp_path, [], lag=0, mode="sync").restore_with(ModelCheckpoint(allow_config_change=True), make_state(0))
    with pytest.raises(ValueError, match="keep"):
        ModelCheckpoint(keep=0)
    with pytest.raises(ValueError, match="resume"):
        ModelCheckpoint(resume="best")


def test_resume_from_named_step_sets_later_steps_aside(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=1, keep=None, async_save=False)
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    run_steps(trainer, ckpt, [1, 2, 3])
    ckpt.finish()
    ckpt2 = ModelCheckpoint(resume=1, every_n_steps=1)
    restored = fake_trainer(tmp_path, [ckpt2]).restore_with(ckpt2, make_state(0))
    assert restored.step == 1 and float(restored.params["w"][0, 0]) == 1.0
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [1]
    assert {p.name for p in (tmp_path / "checkpoints").iterdir()} >= {"2.discarded", "3.discarded"}


def corrupt(step_dir: Path) -> None:
    """Truncates every array data file of a step (what a disk-full or torn copy leaves)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no array data files under {step_dir}"
    for p in files:
        p.write_bytes(p.read_bytes()[:3])


def test_every_step_unusable_raises_and_renames_nothing(tmp_path):
    ckpt = ModelCheckpoint(every_n_steps=1, async_save=False)
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    run_steps(trainer, ckpt, [1, 2])
    ckpt.finish()
    for step in (1, 2):
        corrupt(tmp_path / "checkpoints" / str(step))
    with pytest.raises(RuntimeError, match=r"no usable checkpoint in .* \(step 2: .*; step 1: .*\); restore them"):
        fake_trainer(tmp_path, []).restore_with(ModelCheckpoint(), make_state(0))
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [1, 2]


def toy_fit(run_dir: Path, max_steps: int, callbacks=()):
    plan = BatchPlan(prompts_per_step=2, num_generations=4, mini_batch_size=4)
    trainer = Trainer(plan, max_steps=max_steps, seed=5, callbacks=callbacks, run_dir=run_dir)
    return trainer.fit(ToyModule(), prompt_rows(5))


def test_corrupt_latest_falls_back_to_previous_and_resume_is_exact(tmp_path):
    reference = toy_fit(tmp_path / "reference", 5)
    toy_fit(tmp_path / "run", 4, [ModelCheckpoint(every_n_steps=2, keep=None)])
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert CheckpointIO(ckpt_dir).steps() == [2, 4]
    corrupt(ckpt_dir / "4")

    ckpt = ModelCheckpoint(every_n_steps=2, keep=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = toy_fit(tmp_path / "run", 5, [ckpt])
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("checkpoint step 4" in m and "using step 2 instead" in m for m in messages), messages
    assert ckpt.restored_step == 2
    assert (ckpt_dir / "4.corrupt").is_dir() and CheckpointIO(ckpt_dir).steps() == [2, 4, 5]
    assert (resumed.step, resumed.policy_version, resumed.data_position) == (5, reference.policy_version, 10)
    for got, want in zip(jax.tree.leaves((resumed.params, resumed.opt_state)), jax.tree.leaves((reference.params, reference.opt_state))):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_nnx_state_params_roundtrip(tmp_path):
    from flax import nnx

    params = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
    state = TrainState(step=1, params=params, opt_state=TX.init(params), rng=jnp.zeros(2, jnp.uint32),
                       policy_version=1, data_position=2)
    ckpt = ModelCheckpoint(async_save=False)
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, state)
    ckpt.on_fit_end(trainer.run, state)
    fresh = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(1)), nnx.Param)
    blank = state.replace(step=0, params=fresh, opt_state=TX.init(fresh))
    restored = fake_trainer(tmp_path, []).restore_with(ModelCheckpoint(), blank)
    assert isinstance(restored.params, nnx.State)
    assert np.array_equal(restored.params["kernel"][...], params["kernel"][...])
