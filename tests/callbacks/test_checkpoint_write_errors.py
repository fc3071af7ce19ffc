"""A checkpoint that cannot be written (a full disk, injected as OSError(ENOSPC) where Orbax
renames the finished step into place, on its background thread): one line saying what failed,
where, and the free space against what the checkpoint needs; the finished checkpoints intact;
nothing half-written ever read as a checkpoint; and an exact resume once there is space.

The command-line view of the same fault (exit 1, exactly one line on stderr, no Orbax noise)
is tested on real processes in tests/cli/test_cli_faults.py (slow), with a real tmpfs too.
"""

from __future__ import annotations

import errno
import types

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity

from rlbolt.callback import CallbackList
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.checkpointing.io import CheckpointIO, CheckpointWriteError
from rlbolt.state import StepInfo, TrainState
from fake_fit import FakeFit

TX = optax.adam(0.1)


def make_state(step: int) -> TrainState:
    params = {"w": jnp.full((32, 32), 0.1 * step, jnp.float32)}
    return TrainState(step=step, params=params, opt_state=TX.init(params), rng=jnp.array([7, step], jnp.uint32),
                      policy_version=step, data_position=4 * step)


def fake_trainer(run_dir, callbacks):
    return FakeFit(run_dir, callbacks)


@pytest.fixture
def disk_full_at(monkeypatch):
    """The set of steps (as folder names) whose final rename raises OSError(ENOSPC)."""
    original = atomicity.AtomicRenameTemporaryPath.finalize
    full = set()

    async def finalize(self):
        if self.get_final().name in full:  # the step's folder (its items "state", "meta" pass)
            raise OSError(errno.ENOSPC, "No space left on device", str(self.get_final()))
        return await original(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    return full


# params 32x32 float32 (4096 B) + Adam's mu and nu (2 x 4096 B) + its int32 count (4 B) + the rng (8 B)
NEEDED = "12.0 KB"


@pytest.mark.parametrize("async_save", [True, False])
def test_a_full_disk_is_one_line_and_the_run_resumes_exactly_after(tmp_path, disk_full_at, async_save):
    disk_full_at.add("3")
    ckpt = ModelCheckpoint(every_n_steps=1, keep=None, async_save=async_save)
    trainer = fake_trainer(tmp_path, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    with pytest.raises(CheckpointWriteError) as info:
        for step in (1, 2, 3, 4):  # async: step 3's failure surfaces when step 4 saves
            state = make_state(step)
            trainer.callbacks.on_step_end(trainer.run, StepInfo(step, state, {}, 0.0))
            trainer.last_state = state
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"could not write the checkpoint of step 3 to {tmp_path / 'checkpoints'}: "
                              "no space left on device (free ")
    assert f"this checkpoint needs about {NEEDED})" in message and "(finished checkpoints: [1, 2])" in message
    ckpt.on_exception(trainer.run, info.value)  # what fit does next: closes quietly, tries nothing more

    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert CheckpointIO(tmp_path / "checkpoints", read_only=True).steps() == [1, 2]
    assert not any(n.startswith("3") and "tmp" not in n for n in names), names  # step 3 never looks finished

    # Space is back: a new run resumes from step 2, exactly, and writes step 3 again.
    disk_full_at.clear()
    resumed = ModelCheckpoint(every_n_steps=1, keep=None, async_save=async_save)
    trainer = fake_trainer(tmp_path, [resumed])
    state = trainer.restore_with(resumed, make_state(0))
    assert resumed.restored_step == 2 and (state.step, state.policy_version, state.data_position) == (2, 2, 8)
    assert np.array_equal(np.asarray(state.params["w"]), np.asarray(make_state(2).params["w"]))
    trainer.callbacks.on_step_end(trainer.run, StepInfo(3, make_state(3), {}, 0.0))
    resumed.finish()
    assert not any("tmp" in p.name for p in (tmp_path / "checkpoints").iterdir())  # the writer cleaned up
    assert CheckpointIO(tmp_path / "checkpoints", read_only=True).steps() == [1, 2, 3]
