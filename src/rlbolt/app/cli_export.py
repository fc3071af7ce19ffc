"""`rlbolt export`: a Hugging Face folder from a run directory's newest usable checkpoint.

A run that trains every parameter is exported from its checkpoint alone, not config.yaml nor
the module that trained it, so runs made with `Trainer.fit` from a script export as well as
`rlbolt demo` / `fit` runs. Every checkpoint records what export needs (`meta.model`, written
by ModelCheckpoint): the ModelConfig of the policy's Decoder, where the policy's parameters sit
inside the trainable pytree (PPO keeps them under "policy"), and the tokenizer folder the run
used. Export:

    1. reads the newest usable step read-only (checksums and finiteness verified; NaN weights
       are never exported), retrying when a training process prunes it while it is being read;
    2. builds the Decoder's structure from the recorded ModelConfig (no weights initialised),
       fills it with the restored parameters, names and shapes checked;
    3. writes config.json + safetensors (+ the tokenizer files) with `rlbolt.models.hf_io.save_hf`.

A LoRA run (model.lora, or the demo's lora_rank) checkpoints its adapters only: its base comes
from model.path (or the demo's base), so the run's config.yaml rebuilds the module
(`latest_params`; refused if the base's fingerprint differs from the one the checkpoint
recorded) and export writes the adapters merged into the base, or with `adapter=True` the
adapters alone in PEFT's layout (`rlbolt.models.peft_io`).

Export never writes, renames or cleans anything in the run directory: it is safe while the run
is training.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.app import rundir
from rlbolt.demo.config import DemoConfig, DemoConfigError, is_demo_config
from rlbolt.demo.tasks import episode_tasks

READ_ATTEMPTS = 5


def read_latest(run_dir: str | Path, template: dict | None = None) -> tuple[int, Any, dict]:
    """The newest usable checkpoint, read-only.

    Args:
      run_dir: a run directory with checkpoints/.
      template: {"params", "opt_state", "rng"} to restore into (a rebuilt module's); None
        restores the parameters alone, as saved (nested dicts).

    Returns:
      (step, the restored arrays dict, or the params alone without a template, meta).

    Raises:
      RunDirError: no checkpoints/ folder or no checkpoint in it.
      NoUsableCheckpoint: every checkpoint fails its checks (each reason is listed).
    """
    from rlbolt.checkpointing.io import CheckpointIO, NoUsableCheckpoint

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
                    params = None if template is None else template["params"]
                    step, arrays, meta, _ = io.restore_usable(steps, template, params)
                    return step, arrays, meta
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
    from rlbolt.checkpointing.integrity import named_leaves, path_name
    from rlbolt.models import Decoder
    from rlbolt.models.config import ModelConfig
    from rlbolt.models.stacked_layers import unstack_layer_state

    if model is None:
        raise rundir.RunDirError(f"the checkpoints in {run_dir} record no rlbolt Decoder (the module's `model` was "
                                 "not an rlbolt.models.Decoder), so there is nothing export can write")
    config = ModelConfig(**model["config"]).validate()
    key = model.get("params_key")
    # A run with model.scan_layers may hold its layers stacked (rlbolt.models.stacked_layers): per layer here.
    saved = named_leaves(unstack_layer_state(params[key] if key is not None else params))
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
    """The policy of the newest usable checkpoint, rebuilt from that checkpoint alone (a run
    that trains every parameter).

    Returns:
      (Decoder with the checkpoint's weights, the checkpoint's step, the tokenizer folder the
      run used or None).

    Raises:
      RunDirError: also for a LoRA run (its base is not in the checkpoint: see `latest_params`).
    """
    run_dir = Path(run_dir)
    step, params, meta = read_latest(run_dir)
    if meta.get("frozen") is not None:
        raise rundir.RunDirError(f"{run_dir} trained LoRA adapters on a frozen base, which its checkpoints do not hold; "
                                 f"export needs the run's {rundir.CONFIG_FILE} to reload that base")
    model = meta.get("model")
    decoder = decoder_from_checkpoint(params, model, run_dir)
    return decoder, step, (model or {}).get("tokenizer_folder")


def _module_for(run_dir: Path) -> tuple[Any, Any]:
    """(module with its model built and initial params loaded, the config it was built from)."""
    data = rundir.read_config(run_dir)
    if is_demo_config(data):
        cfg = DemoConfig.from_dict(data)
        module = demo_module(cfg)
        if cfg.task in episode_tasks():
            from rlbolt.plan import BatchPlan
            from rlbolt.setup_context import SetupContext

            module.setup(SetupContext(plan=BatchPlan(cfg.prompts_per_step, cfg.num_generations), seed=cfg.seed))
        from rlbolt.fit_setup import param_key

        module.init_params(param_key(cfg.seed))  # the key a fit initialises from
        return module, None
    from rlbolt.config import references as objects
    from rlbolt.app.build import build_module, build_plan
    from rlbolt.setup_context import SetupContext
    from rlbolt.config import load_config

    cfg = load_config(data, [f"trainer.run_dir={run_dir}"])
    # The model and tokenizer objects the run was built with (a reward is not needed to export).
    module = build_module(cfg, **objects.import_all({k: getattr(cfg.objects, k) for k in ("model", "tokenizer")}))
    module.setup(SetupContext(plan=build_plan(cfg), seed=cfg.trainer.seed))
    return module, cfg


def demo_module(config: DemoConfig):
    """The module a demo config trains: DigitsGRPO for the digit tasks (from `demo.base_run`'s model
    when set), GRPO on episodes for the agent tasks (`rlbolt.demo.episodes.demo_module`)."""
    config = config.resolved()
    if config.task in episode_tasks():
        from rlbolt.demo.episodes import demo_module as episode_module

        return episode_module(config.task, learning_rate=config.learning_rate, hidden_size=config.hidden_size,
                              seed=config.seed)
    from rlbolt.demo.digits import DigitsGRPO

    return DigitsGRPO(config, base_model=demo_base_model(config))


def demo_base_model(config: DemoConfig):
    """The Decoder a demo run starts from when `demo.base_run` names an earlier demo run: that
    run's latest policy (LoRA adapters merged); None without a base run."""
    if config.base_run is None:
        return None
    module, _, _ = latest_params(config.base_run)
    from rlbolt.demo.digits import DigitsGRPO

    if not isinstance(module, DigitsGRPO):
        raise DemoConfigError(f"demo.base_run={config.base_run!r} is not a demo run (its config.yaml has no demo section)")
    if module.lora is None:
        return module.model
    return module.lora.merged_model(nnx.state(module.model, nnx.LoRAParam))


def _trains_adapters(data: dict[str, Any]) -> bool:
    """Whether a run's config.yaml mapping trains LoRA adapters (demo: lora_rank; recipes: model.lora)."""
    if is_demo_config(data):
        return (data["demo"] or {}).get("lora_rank") is not None
    return (data.get("model") or {}).get("lora") is not None


def latest_params(run_dir: str | Path) -> tuple[Any, int, Any]:
    """Restores the newest usable checkpoint's parameters into the run's module, rebuilt from its
    config.yaml (what a LoRA run needs: its frozen base is not in the checkpoint).

    Args:
      run_dir: a run directory with config.yaml and checkpoints/.

    Returns:
      (module whose `model` now holds the restored weights, the checkpoint's step, the
      RunConfig or None for a demo run).

    Raises:
      RunDirError: the directory is not a run or holds no checkpoint.
      FrozenParamsMismatch: the checkpoint was trained on another base than config.yaml loads.
    """
    from rlbolt.checkpointing.meta import check_frozen_identity

    run_dir = Path(run_dir)
    module, cfg = _module_for(run_dir)
    params = module.init_params(jax.random.PRNGKey(0))
    optimizer = module.configure_optimizers()
    template = {"params": params, "opt_state": optimizer.init(params), "rng": jax.random.PRNGKey(0)}
    step, arrays, meta = read_latest(run_dir, template)
    check_frozen_identity(meta.get("frozen"), module.frozen_identity(), run_dir / rundir.CHECKPOINTS_DIR)
    card = module.card()
    nnx.update(card.model, card.policy_params(arrays["params"]))
    return module, step, cfg


@contextlib.contextmanager
def _demo_tokenizer_folder(data: dict[str, Any] | None) -> Iterator[str | None]:
    """For a digit-task demo run: a temporary folder holding its character tokenizer as Hugging
    Face files (the exported folder then serves as a teacher or a model.path); else None."""
    if data is None or not is_demo_config(data) or DemoConfig.from_dict(data).task in episode_tasks():
        yield None
        return
    from rlbolt.data.char_tokenizer_files import save_char_tokenizer
    from rlbolt.demo.digits import demo_tokenizer

    with tempfile.TemporaryDirectory(prefix="rlbolt-demo-tokenizer-") as folder:
        yield str(save_char_tokenizer(demo_tokenizer(), folder))


def export_run(run_dir: str | Path, out: str | Path, *, overwrite: bool = False,
               adapter: bool = False) -> tuple[Path, int]:
    """Writes the newest usable checkpoint of `run_dir` as a Hugging Face folder `out`.

    Args:
      run_dir: the run directory (from `rlbolt demo`, `rlbolt fit` or a script's `Trainer.fit`).
      out: the output folder; it must not exist unless `overwrite`.
      overwrite: replace an existing `out`.
      adapter: a LoRA run only: write the adapters alone as a PEFT folder (adapter_config.json +
        adapter_model.safetensors, loaded on top of model.path) instead of the merged model.

    Returns:
      (the folder written, the checkpoint step it holds).
    """
    from rlbolt.data.gguf_tokenizer import hf_tokenizer_folder
    from rlbolt.models.hf_io import save_hf, tokenizer_source

    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another OUT folder or pass --overwrite")
    data = rundir.read_config(run_dir) if (run_dir / rundir.CONFIG_FILE).is_file() else None
    if data is None or not _trains_adapters(data):
        if adapter:
            raise rundir.RunDirError(f"{run_dir} trained every parameter (no LoRA), so it has no adapter to write; "
                                     "export without --adapter")
        model, step, folder = latest_model(run_dir)
        with _demo_tokenizer_folder(data) as demo_folder, hf_tokenizer_folder(
                tokenizer_source(folder, demo_folder)) as tokenizer_folder:
            save_hf(model, model.config, out, tokenizer_folder=tokenizer_folder, overwrite=overwrite)
        return out, step
    module, step, cfg = latest_params(run_dir)
    card = module.card()
    if adapter:
        from rlbolt.models.peft_io import save_peft_adapter

        base = cfg.model.path if cfg is not None else None
        save_peft_adapter(card.model, module.lora.config, out, base_model=base, overwrite=overwrite)
        return out, step
    model = card.hf_model(nnx.state(card.model, nnx.LoRAParam))  # the adapters merged into the base
    folders = (cfg.model.tokenizer, cfg.model.path) if cfg is not None else ()
    with _demo_tokenizer_folder(data) as demo_folder, hf_tokenizer_folder(
            tokenizer_source(*folders, demo_folder)) as tokenizer_folder:
        save_hf(model, model.config, out, tokenizer_folder=tokenizer_folder, overwrite=overwrite)
    return out, step
