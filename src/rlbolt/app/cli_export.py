"""`rlbolt export`: a Hugging Face folder from a run directory's latest checkpoint.

The run's config.yaml rebuilds the module exactly as training built it (same model shape and
optimizer), which gives Orbax the abstract target to restore into; the restored parameters go
into the module's Decoder and `rlbolt.models.hf_io.save_hf` writes config.json + safetensors.
A LoRA run (model.lora) reloads its base from model.path (refused if its fingerprint differs
from the one the checkpoint recorded) and writes the adapters merged into it, or with
`adapter=True` the adapters alone in PEFT's layout (`rlbolt.models.peft_io`).
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
        module.init_params(jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 0))  # as Trainer._setup derives it
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


def _trains_adapters(data: dict[str, Any]) -> bool:
    """Whether a run's config.yaml mapping trains LoRA adapters (demo: lora_rank; recipes: model.lora)."""
    if is_demo_config(data):
        return (data["demo"] or {}).get("lora_rank") is not None
    return (data.get("model") or {}).get("lora") is not None


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
    from rlbolt.callbacks.checkpoint import check_frozen_identity
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
        step, arrays, meta, _ = io.restore_usable(steps, template, params)
    finally:
        io.close()
    check_frozen_identity(meta.get("frozen"), module.frozen_identity(), ckpt_dir)
    policy = module.policy_params(arrays["params"]) if hasattr(module, "policy_params") else arrays["params"]
    nnx.update(module.model, policy)
    return module, step, cfg


def export_run(run_dir: str | Path, out: str | Path, *, overwrite: bool = False,
               adapter: bool = False) -> tuple[Path, int]:
    """Writes the latest checkpoint of `run_dir` as a Hugging Face folder `out`.

    Args:
      run_dir: the run directory.
      out: the output folder; it must not exist unless `overwrite`.
      overwrite: replace an existing `out`.
      adapter: a LoRA run only: write the adapters alone as a PEFT folder (adapter_config.json +
        adapter_model.safetensors, loaded on top of model.path) instead of the merged model.

    Returns:
      (the folder written, the checkpoint step it holds).
    """
    from rlbolt.models.hf_io import save_hf

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another OUT folder or pass --overwrite")
    if adapter and not _trains_adapters(rundir.read_config(Path(run_dir))):
        raise rundir.RunDirError(f"{run_dir} trained every parameter (no LoRA), so it has no adapter to write; "
                                 "export without --adapter")
    module, step, cfg = latest_params(run_dir)
    lora = getattr(module, "lora", None)
    if adapter:
        from rlbolt.models.peft_io import save_peft_adapter

        base = cfg.model.path if cfg is not None else None
        save_peft_adapter(module.model, lora.config, out, base_model=base, overwrite=overwrite)
        return out, step
    model = module.model if lora is None else lora.merged_model(nnx.state(module.model, nnx.LoRAParam))
    tokenizer_folder = None
    if cfg is not None:
        folder = cfg.model.tokenizer or cfg.model.path
        if folder and (Path(folder) / "tokenizer.json").is_file():
            tokenizer_folder = folder
    save_hf(model, model.config, out, tokenizer_folder=tokenizer_folder, overwrite=overwrite)
    return out, step
