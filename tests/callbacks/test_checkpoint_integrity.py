"""Damaged checkpoints: every way a step can be bad is detected, reported in one line, and the
previous good step is used; NaN weights are never loaded; a directory that had checkpoints and
has none left is refused instead of restarting from step 0.

The checkpoints are written by ModelCheckpoint through a stand-in trainer (no model to compile).
The parameter array holds random bits with bit 30 cleared (finite floats in (-2, 2)): such
data does not compress, so Orbax stores its bytes verbatim and the test can find them in the
data file and flip bytes *inside the array*, which Orbax itself restores without complaint.
"""

from __future__ import annotations

import json
import shutil
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from rlbolt.callback import CallbackList
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.checkpointing.integrity import checksums, numpy_checksum
from rlbolt.checkpointing.io import CheckpointIO, NoUsableCheckpoint
from rlbolt.state import StepInfo, TrainState
from fake_fit import FakeFit

TX = optax.adam(0.1)


def weights(step: int) -> np.ndarray:
    bits = np.random.default_rng(step).integers(0, 2**32, size=(32, 32), dtype=np.uint32)
    return (bits & ~np.uint32(1 << 30)).view(np.float32)


def make_state(step: int, w: np.ndarray | None = None) -> TrainState:
    params = {"w": jnp.asarray(weights(step) if w is None else w)}
    return TrainState(step=step, params=params, opt_state=TX.init(params), rng=jnp.array([7, step], jnp.uint32),
                      policy_version=step, data_position=4 * step)


def fake_trainer(run_dir: Path, callbacks):
    return FakeFit(run_dir, callbacks, settings={"seed": 0})


def write_steps(run_dir: Path, states) -> None:
    ckpt = ModelCheckpoint(every_n_steps=1, keep=None, async_save=False)
    trainer = fake_trainer(run_dir, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    for state in states:
        trainer.callbacks.on_step_end(trainer.run, StepInfo(state.step, state, {}, 0.0))
    ckpt.finish()


def restore(run_dir: Path):
    """Resumes like a new fit would; returns (restored state, [warning messages], ModelCheckpoint)."""
    ckpt = ModelCheckpoint()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fake_trainer(run_dir, [ckpt]).restore_with(ckpt, make_state(0))
    return state, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], ckpt


def data_file_with(step_dir: Path, payload: bytes) -> tuple[Path, int]:
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            at = path.read_bytes().find(payload)
            if at >= 0:
                return path, at
    raise AssertionError(f"the array's bytes are not stored verbatim under {step_dir}")


def test_both_checksum_methods_match_their_references_and_see_every_single_word_change():
    import xxhash

    rng = np.random.default_rng(0)
    arrays = {
        "tenths": np.full((5, 3), 0.1, np.float32),  # 0.1 is not a float32: the rounded bits are hashed
        "bf16": np.asarray(jnp.asarray(rng.normal(size=9), jnp.bfloat16)),
        "f16": rng.normal(size=4).astype(np.float16), "i8": np.arange(-3, 4, dtype=np.int8),
        "i32": np.arange(10, dtype=np.int32), "bool": np.array([True, False, True]),
        "key": np.asarray(jax.random.PRNGKey(3)), "scalar": np.float32(2.5), "one": np.zeros(1, np.float32),
    }
    on_host = checksums(arrays)  # CPU arrays: XXH3 of the bytes, read in place
    on_device = checksums(arrays, dict.fromkeys(arrays, "sum64"))  # what an accelerator computes (jitted)
    for name, x in arrays.items():
        assert on_host[name] == (f"xxh3:{xxhash.xxh3_64_hexdigest(np.ascontiguousarray(x).tobytes())}", True), name
        assert on_device[name] == (numpy_checksum(x), True), name
    base = rng.normal(size=257).astype(np.float32)
    words = base.view(np.uint32)
    reference = numpy_checksum(base)
    for i in rng.choice(257, 40, replace=False):
        for bit in (0, 17, 31):
            changed = words.copy()
            changed[i] ^= np.uint32(1 << bit)
            assert numpy_checksum(changed.view(np.float32)) != reference, (i, bit)
    swapped = base.copy()
    swapped[[3, 4]] = swapped[[4, 3]]  # same values, other places: a position-free sum would miss it
    assert numpy_checksum(swapped) != reference
    for method in ("xxh3", "sum64"):
        assert checksums({"nan": np.array([1.0, np.nan], np.float32)}, {"nan": method})["nan"][1] is False
    key = jax.random.key(3)  # a typed key array: hashed through its key data
    assert checksums({"k": key})["k"][0] == f"xxh3:{xxhash.xxh3_64_hexdigest(np.asarray(jax.random.key_data(key)).tobytes())}"


def test_flipped_bytes_inside_the_array_are_caught_and_the_previous_step_is_used(tmp_path):
    write_steps(tmp_path, [make_state(1), make_state(2)])
    step_dir = tmp_path / "checkpoints" / "2"
    path, at = data_file_with(step_dir, weights(2).tobytes()[400:432])
    data = bytearray(path.read_bytes())
    for i in range(8):  # 8 bytes inside the array: two float32 values change, both stay finite
        data[at + 4 * i] ^= 0x5A
    path.write_bytes(bytes(data))

    # Orbax alone restores the damaged values without a word.
    manager = ocp.CheckpointManager(tmp_path / "checkpoints", options=ocp.CheckpointManagerOptions(read_only=True))
    raw = manager.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]["w"]
    manager.close()
    assert np.isfinite(raw).all() and not np.array_equal(np.asarray(raw), weights(2))

    state, messages, ckpt = restore(tmp_path)
    assert ckpt.restored_step == 1 and np.array_equal(np.asarray(state.params["w"]), weights(1))
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "step 2" in messages[0] and "checksum mismatch in params/w" in messages[0] and "2.corrupt" in messages[0]
    assert (tmp_path / "checkpoints" / "2.corrupt").is_dir()
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [1]


def test_nan_weights_saved_by_a_diverged_run_are_never_loaded(tmp_path):
    nan_w = weights(2).copy()
    nan_w[3, 4] = np.nan
    write_steps(tmp_path, [make_state(1), make_state(2, nan_w)])
    state, messages, ckpt = restore(tmp_path)
    assert ckpt.restored_step == 1 and np.isfinite(np.asarray(state.params["w"])).all()
    assert "non-finite values (NaN or inf) in params/w (it was saved that way" in messages[0]


def edit_meta(step_dir: Path, change) -> None:
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(change(meta)))


@pytest.mark.parametrize("change, reason", [
    (lambda m: {}, "its metadata has no integrity record"),
    (lambda m: {**m, "progress": {**m["progress"], "step": "2"}}, "meta.progress.step is '2' (str), expected an integer"),
    (lambda m: {**m, "progress": {k: v for k, v in m["progress"].items() if k != "data_position"}},
     "meta.progress.data_position is missing"),
    (lambda m: {**m, "producer": {**m["producer"], "mode": 3}}, "meta.producer.mode is 3"),
    (lambda m: {**m, "callbacks": []}, "meta.callbacks is [], expected {name: state}"),
    (lambda m: {**m, "integrity": {**m["integrity"], "state": {"params/w": {"dtype": "float32"}}}},
     "meta.integrity.state['params/w'] is malformed"),
    (lambda m: {**m, "format_version": 1}, "meta.format_version is 1"),
])
def test_damaged_metadata_falls_back_with_the_field_named(tmp_path, change, reason):
    write_steps(tmp_path, [make_state(1), make_state(2)])
    edit_meta(tmp_path / "checkpoints" / "2", change)
    state, messages, ckpt = restore(tmp_path)
    assert ckpt.restored_step == 1 and state.step == 1 and state.data_position == 4
    assert len(messages) == 1 and reason in messages[0], messages


def test_unreadable_metadata_falls_back(tmp_path):
    write_steps(tmp_path, [make_state(1), make_state(2)])
    (tmp_path / "checkpoints" / "2" / "meta" / "metadata").write_text('{"progress": {"st')
    _, messages, ckpt = restore(tmp_path)
    assert ckpt.restored_step == 1 and "its metadata cannot be read" in messages[0]


def test_every_step_bad_is_a_one_line_refusal_listing_each(tmp_path):
    write_steps(tmp_path, [make_state(1), make_state(2)])
    edit_meta(tmp_path / "checkpoints" / "2", lambda m: {**m, "format_version": "2"})
    (tmp_path / "checkpoints" / "1" / "meta" / "metadata").write_text("")
    with pytest.raises(NoUsableCheckpoint) as info:
        restore(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert "step 2: meta.format_version is '2'" in message and "step 1: its metadata cannot be read" in message
    assert CheckpointIO(tmp_path / "checkpoints").steps() == [1, 2]  # nothing renamed: maybe not corruption


def test_a_run_whose_checkpoints_all_vanished_is_refused_not_restarted(tmp_path):
    write_steps(tmp_path, [make_state(1), make_state(2)])
    for step in (1, 2):
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
    with pytest.raises(NoUsableCheckpoint, match=r"had checkpoints \(the first at step 1\) but none is left"):
        restore(tmp_path)
    # Starting over is explicit.
    ckpt = ModelCheckpoint(resume=None)
    assert fake_trainer(tmp_path, [ckpt]).restore_with(ckpt, make_state(0)) is None


def test_a_model_change_is_refused_in_one_line_naming_the_array(tmp_path):
    write_steps(tmp_path, [make_state(1)])
    ckpt = ModelCheckpoint(allow_config_change=True)
    bigger = make_state(0, np.zeros((32, 48), np.float32))
    with pytest.raises(NoUsableCheckpoint) as info:
        fake_trainer(tmp_path, [ckpt]).restore_with(ckpt, bigger)
    assert "params/w is float32(32, 32) in the checkpoint but float32(32, 48) in this run" in str(info.value)
    assert "\n" not in str(info.value)
