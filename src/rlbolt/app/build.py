"""Config -> a ready run: the module, the Trainer with its callbacks, and the prompt rows.

    cfg = load_config("recipes/configs/grpo_gsm8k.yaml", ["trainer.max_steps=3"])
    module, trainer, train_rows, val_rows = build_run(cfg)
    state = trainer.fit(module, train_rows, val_rows)

`assemble_run` builds the pieces and checks everything that can be checked without training
(the batch plan against the algorithm, every data row and its prompt against the tokenizer,
the model and tokenizer folders, the reward, Python objects passed in) and writes nothing.
`build_run` then opens the run folder and writes config.yaml. The `rlbolt` command calls
`assemble_run` before it opens the folder, so a bad input leaves nothing behind.
Recipes and the CLI call this; a script that wants something else builds the pieces itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rlbolt.app import input_checks as checks
from rlbolt.config import references as pyobjects
from rlbolt.config.algorithms import algorithm_class
from rlbolt.app import rundir
from rlbolt.config import ConfigError, RunConfig, config_to_dict, load_config, save_config
from rlbolt.data import DataFileError, gsm8k_style_rows, load_rows
from rlbolt.fit_checks import check_fit
from rlbolt.plan import BatchPlan, PlanError
from rlbolt.trainer import Trainer

OBJECT_NAMES = ("model", "tokenizer", "reward")


class Run(NamedTuple):
    """Everything `Trainer.fit` needs, built and checked (see `assemble_run`).

    Attributes:
      module: the RLModule.
      trainer: the Trainer with its callbacks.
      train_rows: the training prompt rows.
      val_rows: the validation rows, or None.
      config: the resolved config with the `objects` section recording the Python objects used.
    """

    module: Any
    trainer: Trainer
    train_rows: list
    val_rows: list | None
    config: RunConfig


def build_module(cfg: RunConfig, **objects: Any):
    """The module class registered as `cfg.algorithm.name` (a ready one, or a user's class that
    objects.module named), built from the config (objects: model=, tokenizer=, reward=)."""
    return algorithm_class(cfg.algorithm.name)(cfg, **objects)


def load_data(cfg: RunConfig, check: Callable[[Mapping[str, Any]], None] | None = None
              ) -> tuple[list[dict], list[dict] | None]:
    """(train rows, val rows or None) from `cfg.data`: files, or the built-in GSM8K-style rows.

    Args:
      cfg: the run config.
      check: called on every row (see `rlbolt.data.load_rows`), built-in rows included.

    Raises:
      ConfigError: a data file is missing or holds a bad row (naming the field, file and row).
    """
    d = cfg.data
    required = (d.prompt_field, d.answer_field)

    def rows(field: str, path: str | None, builtin: int, seed: int) -> list[dict] | None:
        try:
            if path:
                return load_rows(path, required=required, check=check)
            out = gsm8k_style_rows(builtin, seed) if builtin else None
            for index, row in enumerate(out or []):
                if check is not None:
                    checks.check_builtin_row(check, row, index)
            return out
        except DataFileError as error:
            raise ConfigError(f"{field}: {error}") from None

    train = rows("data.train", d.train, d.builtin_train_rows, d.builtin_seed)
    # Another seed for the built-in validation rows: no train overlap by design.
    val = rows("data.val", d.val, d.builtin_val_rows, d.builtin_seed + 1)
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
    if c.checkpoint:  # records the resolved config: a resume that changes the math is refused
        out.append(cb.ModelCheckpoint(every_n_steps=c.checkpoint_every_n_steps, keep=c.keep,
                                      resume="latest" if c.resume else None, config=config_to_dict(cfg)))
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


def build_plan(cfg: RunConfig) -> BatchPlan:
    """The BatchPlan of the config's plan section (checked when built)."""
    return BatchPlan(**dataclasses.asdict(cfg.plan))


def build_trainer(cfg: RunConfig, callbacks: Sequence[Any] = ()) -> Trainer:
    """A Trainer from the Plan and Trainer sections; `callbacks` come after the built-in ones."""
    t = cfg.trainer
    plan = build_plan(cfg)
    run_dir = t.run_dir or str(Path("runs") / f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Trainer(plan, max_steps=t.max_steps, max_epochs=t.max_epochs, seed=t.seed, data_seed=t.data_seed,
                   shuffle=cfg.data.shuffle, callbacks=[*build_callbacks(cfg, run_dir), *callbacks], mode=t.mode,
                   max_staleness=t.max_staleness, val_every_n_steps=t.val_every_n_steps,
                   val_batch_size=t.val_batch_size, run_dir=run_dir, prefetch_timeout_s=t.prefetch_timeout_s,
                   mesh=dataclasses.asdict(cfg.mesh), placement=t.placement)


def start_distributed(cfg: RunConfig) -> bool:
    """Starts `jax.distributed` as `cfg.distributed` says (a no-op for one process); call it
    before anything touches a device. Returns whether several processes take part."""
    from rlbolt.distributed import initialize

    d = cfg.distributed
    return initialize(d.mode, coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                      process_id=d.process_id, heartbeat_timeout_s=d.heartbeat_timeout_s,
                      initialization_timeout_s=d.initialization_timeout_s)


def assemble_run(cfg: RunConfig, *, callbacks: Sequence[Any] = (), **objects: Any) -> Run:
    """Builds and checks a run without writing anything (no folder, no config.yaml).

    Checked here, each error naming the config field: Python objects named in `cfg.objects`
    import; `model.path` holds a supported model (config.json and safetensors headers, not
    the weights); the tokenizer folder loads; every data row has its fields and a prompt the
    tokenizer encodes (naming the file and line); the plan fits the algorithm (e.g. group
    advantages need num_generations >= 2) and the data (at least prompts_per_step rows).

    Args:
      cfg: a resolved RunConfig (from `load_config`).
      callbacks: extra callbacks, after the built-in ones.
      **objects: model=, tokenizer=, reward= passed to the module instead of building them;
        recorded in the returned config's `objects` section (see `rlbolt.app.objects`).

    Returns:
      The Run.

    Raises:
      ConfigError: anything above (PlanError for a plan the algorithm cannot train with).
      TypeError: an object other than model, tokenizer or reward.
    """
    unknown = sorted(set(objects) - set(OBJECT_NAMES))
    if unknown:
        raise TypeError(f"build_run got unexpected object(s) {unknown}; it takes {list(OBJECT_NAMES)}")
    given = {name: obj for name, obj in objects.items() if obj is not None}
    if given:  # recorded so that `rlbolt resume` rebuilds the same run, or refuses in one line
        cfg = dataclasses.replace(cfg, objects=dataclasses.replace(
            cfg.objects, **{name: pyobjects.record(obj) for name, obj in given.items()}))
    named = {name: getattr(cfg.objects, name) for name in OBJECT_NAMES if name not in given}
    objects = {**pyobjects.import_all(named), **given}
    from rlbolt.modules.prompts import PromptEncoder

    model_config = None if "model" in objects else checks.model_config(cfg)  # before the tokenizer: model.path may hold both
    tokenizer = objects.get("tokenizer") or checks.tokenizer(cfg)
    if model_config is not None:
        checks.check_vocab(cfg, model_config, tokenizer.vocab_size)
    d = cfg.data
    encoder = PromptEncoder(tokenizer, prompt_field=d.prompt_field, max_prompt_tokens=d.max_prompt_tokens,
                            system_prompt=d.system_prompt, use_chat_template=d.use_chat_template)
    builtin = objects.get("tokenizer") is None and not (cfg.model.tokenizer or cfg.model.path)
    train, val = load_data(cfg, check=lambda row: checks.check_prompt(encoder, row, builtin))
    if cfg.reward.executor == "process" and "reward" in objects:
        checks.check_picklable(objects["reward"])
    module = build_module(cfg, **{**objects, "tokenizer": tokenizer})
    try:
        trainer = build_trainer(cfg, callbacks)
    except PlanError as error:
        raise PlanError(f"plan: {error}") from None
    except ValueError as error:
        raise ConfigError(f"trainer: {error}") from None
    if len(train) < cfg.plan.prompts_per_step:  # check_fit says the same in the Trainer's words
        source = f"data.train={d.train}" if d.train else f"data.builtin_train_rows={d.builtin_train_rows}"
        raise ConfigError(f"{source} gives {len(train)} prompt(s), fewer than plan.prompts_per_step="
                          f"{cfg.plan.prompts_per_step}: every step would repeat prompts; add rows or lower "
                          "plan.prompts_per_step")
    try:
        trainer.plan = check_fit(trainer.plan, module, train, val, val_every_n_steps=trainer.val_every_n_steps)
    except PlanError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return Run(module, trainer, train, val, cfg)


def build_run(cfg: RunConfig, *, callbacks: Sequence[Any] = (), **objects: Any):
    """Builds and checks everything a run needs (`assemble_run`), then opens the run folder and
    writes the resolved config to `<run_dir>/config.yaml` (Python objects recorded in it).

    A folder that already holds a run is reused: running the same script again continues it
    (ModelCheckpoint resumes from the newest checkpoint).

    Args:
      cfg: a resolved RunConfig (from `load_config`).
      callbacks: extra callbacks, after the built-in ones.
      **objects: model=, tokenizer=, reward= passed to the module instead of building them.

    Returns:
      (module, trainer, train_rows, val_rows or None).
    """
    run = assemble_run(cfg, callbacks=callbacks, **objects)
    if run.trainer.is_main_process:
        run_dir = rundir.prepare_run_dir(run.trainer.run_dir, allow_existing=True)
        save_config(run.config, run_dir / rundir.CONFIG_FILE)
    return run.module, run.trainer, run.train_rows, run.val_rows


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
