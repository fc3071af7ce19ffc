"""`rlbolt export`: a Hugging Face folder from a run directory's newest usable checkpoint.

Export needs the checkpoint alone, not config.yaml nor the module that trained it, so it works
on runs made with `Trainer.fit` from a script as well as on `rlbolt demo` / `fit` runs. Every
checkpoint records what export needs (`meta.model`, written by ModelCheckpoint): the
ModelConfig of the policy's Decoder, where the policy's parameters sit inside the trainable
pytree (PPO keeps them under "policy"), and the tokenizer folder the run used. Export:

    1. reads the newest usable step read-only (checksums and finiteness verified; NaN weights
       are never exported), retrying when a training process prunes it while it is being read;
    2. builds the Decoder's structure from the recorded ModelConfig (no weights initialised),
       fills it with the restored parameters, names and shapes checked;
    3. writes config.json + safetensors (+ the tokenizer files) with `rlbolt.models.hf_io.save_hf`.

It never writes, renames or cleans anything in the run directory: it is safe while the run is
training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.app import rundir

READ_ATTEMPTS = 5


def is_demo_config(data: dict[str, Any]) -> bool:
    """True when a config.yaml mapping was written by `rlbolt demo` (a single `demo` section)."""
    return set(data) == {"demo"}


def read_latest(run_dir: str | Path) -> tuple[int, Any, dict]:
    """The newest usable checkpoint's parameters (as saved) and metadata, read-only.

    Args:
      run_dir: a run directory with checkpoints/.

    Returns:
      (step, params as nested dicts, meta).

    Raises:
      RunDirError: no checkpoints/ folder or no checkpoint in it.
      NoUsableCheckpoint: every checkpoint fails its checks (each reason is listed).
    """
    from rlbolt.callbacks.checkpoint_io import CheckpointIO, NoUsableCheckpoint

    ckpt_dir = Path(run_dir) / rundir.CHECKPOINTS_DIR
    if not ckpt_dir.is_dir():
        raise rundir.RunDirError(f"{run_dir} has no {rundir.CHECKPOINTS_DIR}/ folder; is it a run directory?")
    for attempt in range(1, READ_ATTEMPTS + 1):
        # A training process may prune or rename steps while they are listed or read: list again.
        try:
            io = CheckpointIO(ckpt_dir, read_only=True)
            try:
                steps = io.steps()
                if not steps:
                    raise rundir.RunDirError(f"{ckpt_dir} holds no checkpoint; a run saves one at its end, when "
                                             "stopped by Ctrl-C or SIGTERM, and every checkpoint_every_n_steps")
                try:
                    step, params, meta, _ = io.restore_usable(steps)
                    return step, params, meta
                except NoUsableCheckpoint:
                    if attempt == READ_ATTEMPTS or io.steps() == steps:
                        raise
            finally:
                io.close()
        except FileNotFoundError as error:
            if attempt == READ_ATTEMPTS:
                raise rundir.RunDirError(f"the checkpoints in {ckpt_dir} kept changing while they were read "
                                         f"({error.strerror}: {error.filename}); try again") from None
    raise AssertionError("unreachable")


def decoder_from_checkpoint(params: Any, model: dict | None, run_dir: Path):
    """The policy's Decoder holding the checkpoint's parameters (see the module docstring)."""
    from rlbolt.callbacks.checkpoint_integrity import named_leaves, path_name
    from rlbolt.models import Decoder
    from rlbolt.models.config import ModelConfig

    if model is None:
        raise rundir.RunDirError(f"the checkpoints in {run_dir} record no rlbolt Decoder (the module's `model` was "
                                 "not an rlbolt.models.Decoder), so there is nothing export can write")
    config = ModelConfig(**model["config"]).validate()
    key = model.get("params_key")
    saved = named_leaves(params[key] if key is not None else params)
    graphdef, template = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))), nnx.Param)

    def fill(path, leaf):
        name = path_name(path)
        if name not in saved:
            raise rundir.RunDirError(f"the checkpoint in {run_dir} has no parameter {name} that a {config.architecture} "
                                     "Decoder of its recorded config needs")
        value = jnp.asarray(saved[name])
        if value.shape != leaf.shape:
            raise rundir.RunDirError(f"parameter {name} is {value.shape} in the checkpoint, {leaf.shape} in the "
                                     "recorded model config")
        return value.astype(leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, template))


def latest_model(run_dir: str | Path) -> tuple[Any, int, str | None]:
    """The policy of the newest usable checkpoint, rebuilt from that checkpoint alone.

    Returns:
      (Decoder with the checkpoint's weights, the checkpoint's step, the tokenizer folder the
      run used or None).
    """
    run_dir = Path(run_dir)
    step, params, meta = read_latest(run_dir)
    model = meta.get("model")
    decoder = decoder_from_checkpoint(params, model, run_dir)
    return decoder, step, (model or {}).get("tokenizer_folder")


def export_run(run_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> tuple[Path, int]:
    """Writes the newest usable checkpoint of `run_dir` as a Hugging Face folder `out`.

    Args:
      run_dir: the run directory (from `rlbolt demo`, `rlbolt fit` or a script's `Trainer.fit`).
      out: the output folder; it must not exist unless `overwrite`.
      overwrite: replace an existing `out`.

    Returns:
      (the folder written, the checkpoint step it holds).
    """
    from rlbolt.models.hf_io import save_hf

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another OUT folder or pass --overwrite")
    model, step, folder = latest_model(run_dir)
    tokenizer_folder = folder if folder and (Path(folder) / "tokenizer.json").is_file() else None
    save_hf(model, model.config, out, tokenizer_folder=tokenizer_folder, overwrite=overwrite)
    return out, step
