"""NaNGuard: a module whose step k goes NaN stops naming step k after saving step k - 1 (which then
restores to exactly the state an uninterrupted k - 1 step run ends with), or skips the update."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.batch import Batch
from rlbolt.callback import Callback
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.checkpointing.io import CheckpointIO
from rlbolt.callbacks.nan_guard import NaNGuard, NonFiniteError
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

PROMPTS_PER_STEP = 2


class NaNAtStep(ToyModule):
    """Advantages of the 1-based steps in `nan_steps` are NaN, so their loss and gradients are."""

    def __init__(self, nan_steps=()):
        super().__init__()
        self.nan_steps = set(nan_steps)

    def on_advantage(self, batch: Batch) -> Batch:
        batch = super().on_advantage(batch)
        if int(np.asarray(batch["prompt_index"])[0]) // PROMPTS_PER_STEP + 1 in self.nan_steps:
            batch = batch.with_columns(advantages=np.full_like(np.asarray(batch["advantages"]), np.nan))
        return batch


class Record(Callback):
    def __init__(self):
        self.infos = []

    def on_step_end(self, trainer, info):
        # The params on the host: the next step's update donates (deletes) the device arrays.
        self.infos.append(dataclasses.replace(info, state=info.state.replace(params=jax.device_get(info.state.params))))


def fit(run_dir, max_steps, callbacks, nan_steps=()):
    plan = BatchPlan(prompts_per_step=PROMPTS_PER_STEP, num_generations=4)
    trainer = Trainer(plan, max_steps=max_steps, seed=1, callbacks=callbacks, run_dir=run_dir)
    return trainer.fit(NaNAtStep(nan_steps), prompt_rows(16))


def assert_same_leaves(a, b):
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_stop_saves_last_good_step_which_restores(tmp_path):
    guard = NaNGuard()
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite loss=nan.*last good state \(step 2\)"):
        # No periodic saves: the step-2 checkpoint can only come from the guard.
        fit(tmp_path / "run", 5, [guard, ModelCheckpoint(every_n_steps=None)], nan_steps={3})
    assert guard.saved_step == 2
    assert CheckpointIO(tmp_path / "run" / "checkpoints").steps() == [2]

    reference = fit(tmp_path / "reference", 2, [])
    ckpt = ModelCheckpoint(resume=2)
    restored = fit(tmp_path / "run", 2, [ckpt])  # max_steps reached: fit returns the restored state
    assert ckpt.restored_step == 2
    assert (restored.step, restored.policy_version, restored.data_position) == (2, reference.policy_version, 4)
    assert_same_leaves((restored.params, restored.opt_state, restored.rng), (reference.params, reference.opt_state, reference.rng))


def test_stop_without_model_checkpoint_saves_its_own(tmp_path):
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite .*step 0"):
        fit(tmp_path, 3, [NaNGuard(metrics=("grad_norm",))], nan_steps={1})
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [0]


def test_skip_leaves_state_unchanged_and_counts(tmp_path):
    record = Record()
    final = fit(tmp_path, 4, [NaNGuard(action="skip"), record], nan_steps={3})
    infos = record.infos
    assert [i.metrics["nan_guard/skipped_updates"] for i in infos] == [0.0, 0.0, 1.0, 0.0]
    assert np.isnan(infos[2].metrics["loss"])
    assert_same_leaves(infos[2].state.params, infos[1].state.params)  # the NaN update was not applied
    assert not np.array_equal(infos[3].state.params["table"], infos[2].state.params["table"])
    assert np.isfinite(np.asarray(final.params["table"])).all()


def test_skip_stops_after_consecutive_skips(tmp_path):
    with pytest.raises(NonFiniteError, match=r"step 3: 2 consecutive steps"):
        fit(tmp_path, 5, [NaNGuard(action="skip", max_consecutive_skips=2)], nan_steps={2, 3, 4})


def test_guard_runs_before_checkpoint_whatever_the_list_order(tmp_path):
    from rlbolt.callback import CallbackList

    guard, checkpoint = NaNGuard(), ModelCheckpoint()
    assert CallbackList([checkpoint, guard]).callbacks == [guard, checkpoint]
    with pytest.raises(ValueError, match="action"):
        NaNGuard(action="ignore")
