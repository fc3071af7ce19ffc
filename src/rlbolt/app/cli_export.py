"""`rlbolt export`: a Hugging Face folder from a run directory's latest checkpoint.

The run's config.yaml rebuilds the module exactly as training built it (same model shape and
optimizer), which gives Orbax the abstract target to restore into; the restored parameters go
into the module's Decoder and `rlbolt.models.hf_io.save_hf` writes config.json + safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
from flax import nnx

from rlbolt.app import rundir
from rlbolt.app.demo import DemoConfig, DigitsGRPO


def is_demo_config(data: dict[str, Any]) -> bool:
    """True when a config.yaml mapping was written by `rlbolt demo` (a single `demo` section)."""
    return set(data) == {"demo"}


def _module_for(run_dir: Path) -> tuple[Any, Any]:
    """(module with its model built and initial params loaded, the config it was built from)."""
    data = rundir.read_config(run_dir)
    if is_demo_config(data):
        cfg = DemoConfig.from_dict(data)
        module = DigitsGRPO(cfg)
        module.init_params(jax.random.PRNGKey(cfg.seed))
        return module, None
    from rlbolt.app.build import build_module, build_trainer
    from rlbolt.app.config import load_config

    from rlbolt.app import objects

    cfg = load_config(data, [f"trainer.run_dir={run_dir}"])
    # The model and tokenizer objects the run was built with (a reward is not needed to export).
    module = build_module(cfg, **objects.resolve_all({k: getattr(cfg.objects, k) for k in ("model", "tokenizer")}))
    module.trainer = build_trainer(cfg)
    module.setup(module.trainer)
    return module, cfg


def latest_params(run_dir: str | Path) -> tuple[Any, int, Any]:
    """Restores the newest usable checkpoint's parameters into the run's module.

    Args:
      run_dir: a run directory with config.yaml and checkpoints/.

    Returns:
      (module whose `model` now holds the restored weights, the checkpoint's step, the
      RunConfig or None for a demo run).

    Raises:
      RunDirError: the directory is not a run or holds no checkpoint.
    """
    from rlbolt.callbacks.checkpoint_io import CheckpointIO

    run_dir = Path(run_dir)
    module, cfg = _module_for(run_dir)
    ckpt_dir = run_dir / rundir.CHECKPOINTS_DIR
    io = CheckpointIO(ckpt_dir, async_save=False) if ckpt_dir.is_dir() else None
    steps = io.steps() if io is not None else []
    if not steps:
        raise rundir.RunDirError(f"{ckpt_dir} holds no checkpoint; train with checkpoints first "
                                 "(the demo always saves its last step)")
    try:
        params = module.init_params(jax.random.PRNGKey(0))
        optimizer = module.configure_optimizers()
        template = {"params": params, "opt_state": optimizer.init(params), "rng": jax.random.PRNGKey(0)}
        step, arrays, _, _ = io.restore_usable(steps, template, params)
    finally:
        io.close()
    nnx.update(module.model, arrays["params"])
    return module, step, cfg


def export_run(run_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> tuple[Path, int]:
    """Writes the latest checkpoint of `run_dir` as a Hugging Face folder `out`.

    Args:
      run_dir: the run directory.
      out: the output folder; it must not exist unless `overwrite`.
      overwrite: replace an existing `out`.

    Returns:
      (the folder written, the checkpoint step it holds).
    """
    from rlbolt.models.hf_io import save_hf

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another OUT folder or pass --overwrite")
    module, step, cfg = latest_params(run_dir)
    model = module.model
    tokenizer_folder = None
    if cfg is not None:
        folder = cfg.model.tokenizer or cfg.model.path
        if folder and (Path(folder) / "tokenizer.json").is_file():
            tokenizer_folder = folder
    save_hf(model, model.config, out, tokenizer_folder=tokenizer_folder, overwrite=overwrite)
    return out, step
