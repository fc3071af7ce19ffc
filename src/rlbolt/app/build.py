"""Config -> a ready run: the module, the Trainer with its callbacks, and the prompt rows.

    cfg = load_config("recipes/configs/grpo_gsm8k.yaml", ["trainer.max_steps=3"])
    module, trainer, train_rows, val_rows = build_run(cfg)
    state = trainer.fit(module, train_rows, val_rows)

Recipes and the CLI call this; a script that wants something else builds the pieces itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbolt.app.config import ConfigError, RunConfig, load_config, save_config
from rlbolt.data import gsm8k_style_rows, load_rows
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer



def build_module(cfg: RunConfig, **objects: Any):
    """The ready module named by `cfg.algorithm.name` (objects: model=, tokenizer=, reward=)."""
    from rlbolt.modules import MODULES

    return MODULES[cfg.algorithm.name](cfg, **objects)


def load_data(cfg: RunConfig) -> tuple[list[dict], list[dict] | None]:
    """(train rows, val rows or None) from `cfg.data`: files, or the built-in GSM8K-style rows."""
    d = cfg.data
    required = (d.prompt_field, d.answer_field)
    train = load_rows(d.train, required=required) if d.train else gsm8k_style_rows(d.builtin_train_rows, d.builtin_seed)
    if d.val:
        val = load_rows(d.val, required=required)
    elif d.builtin_val_rows > 0:
        val = gsm8k_style_rows(d.builtin_val_rows, d.builtin_seed + 1)  # another seed: no train overlap by design
    else:
        val = None
    return train, val


def build_callbacks(cfg: RunConfig, run_dir: str | Path) -> list:
    """The built-in callbacks the Callbacks section asks for (each declares its own run order).

    Args:
      cfg: the run config.
      run_dir: the run folder (HF exports go to `<run_dir>/hf/`).
    """
    from rlbolt import callbacks as cb

    c, out = cfg.callbacks, []
    if c.nan_guard:
        out.append(cb.NaNGuard())
    if c.lr_monitor:
        out.append(cb.LearningRateMonitor())
    if c.throughput:
        out.append(cb.Throughput())
    if c.offload:
        out.append(cb.CPUOffload())
    if c.checkpoint_every_n_steps:
        out.append(cb.ModelCheckpoint(every_n_steps=c.checkpoint_every_n_steps, keep=c.keep, resume="latest" if c.resume else None))
    if c.metrics:
        out.append(cb.MetricsLogger(writer=list(c.metrics), every_n_steps=c.log_every_n_steps, wandb_project=c.wandb_project))
    if c.progress:
        out.append(cb.ProgressBar())
    if c.timeline:
        out.append(cb.TimelineLogger())
    if c.early_stopping_metric:
        out.append(cb.EarlyStopping(c.early_stopping_metric, mode=c.early_stopping_mode, patience=c.early_stopping_patience))
    if c.export_hf:
        out.append(cb.HFExport(Path(run_dir) / "hf"))
    return out


def build_trainer(cfg: RunConfig, callbacks: Sequence[Any] = ()) -> Trainer:
    """A Trainer from the Plan and Trainer sections; `callbacks` come after the built-in ones."""
    t = cfg.trainer
    plan = BatchPlan(**dataclasses.asdict(cfg.plan))
    run_dir = t.run_dir or str(Path("runs") / f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Trainer(plan, max_steps=t.max_steps, max_epochs=t.max_epochs, seed=t.seed, data_seed=t.data_seed,
                   shuffle=cfg.data.shuffle, callbacks=[*build_callbacks(cfg, run_dir), *callbacks], mode=t.mode,
                   max_staleness=t.max_staleness, val_every_n_steps=t.val_every_n_steps,
                   val_batch_size=t.val_batch_size, run_dir=run_dir, prefetch_timeout_s=t.prefetch_timeout_s)


def build_run(cfg: RunConfig, *, callbacks: Sequence[Any] = (), **objects: Any):
    """Builds everything a run needs and writes the resolved config to `<run_dir>/config.yaml`.

    Args:
      cfg: a resolved RunConfig (from `load_config`).
      callbacks: extra callbacks, after the built-in ones.
      **objects: model=, tokenizer=, reward= passed to the module instead of building them.

    Returns:
      (module, trainer, train_rows, val_rows or None).
    """
    module = build_module(cfg, **objects)
    trainer = build_trainer(cfg, callbacks)
    train, val = load_data(cfg)
    if trainer.is_main_process:
        save_config(cfg, Path(trainer.run_dir) / "config.yaml")
    return module, trainer, train, val


def parse_args(argv: Sequence[str] | None, default_config: str | Path | None, *, algorithm: str | None = None,
               description: str | None = None) -> RunConfig:
    """`[--config PATH] [section.key=value ...]` -> a resolved RunConfig.

    Args:
      argv: the arguments (None: sys.argv[1:]).
      default_config: the YAML used when --config is not given.
      algorithm: when set, the config's algorithm.name must be this (a recipe is one algorithm).
      description: the --help text.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config, help="YAML config (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.max_steps=10")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if algorithm is not None and cfg.algorithm.name != algorithm:
        raise ConfigError(f"this recipe trains {algorithm!r} but the config says algorithm.name={cfg.algorithm.name!r}; "
                          f"use recipes/{cfg.algorithm.name}_gsm8k.py or drop the override")
    return cfg
