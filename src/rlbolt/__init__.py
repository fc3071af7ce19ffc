"""rlbolt: a Lightning-style trainer for RL post-training of language models in JAX.

The main classes are importable from the top level (loaded on first use, so `rlbolt --help`
does not pay for importing JAX):

    from rlbolt import Trainer, RLModule, Callback, BatchPlan

Layout (a test keeps this list complete):

    the user-facing core
      trainer          Trainer: the fit loop
      module           RLModule: the hooks an algorithm overrides; ModuleCard: its declared language model
      callback         Callback, CallbackList, Periodic
      run_info         RunInfo, Control, Restore: what a callback sees of a fit and may ask of it
      setup_context    SetupContext: what a module's setup is told about the run
      state            TrainState, StepInfo
      batch            Batch: named columns with a leading sample axis
      plan             BatchPlan: global / mini / micro batch sizes
    the loop's own parts
      producer/        the stage threads around the ExperienceDock, the weight store
      update           the jitted update (gradient accumulation + optimizer step)
      fit_setup        what fit builds before its first step: callbacks, roles, module, RunInfo, update
      master_weights   float32 master weights behind bfloat16 params (model.master_weights)
      train_batch      one global batch's updates (iterations x mini batches, one host sync)
      validation       Trainer.validate's loop (the Evaluation callback decides when it runs)
      fit_checks       what fit refuses before building anything
      step_metrics     a step's metrics, assembled in one place
      signals          SIGINT / SIGTERM as a stop at the next step boundary
      timeline         start / end events of every stage call and update
      checkpointing/   checkpoint I/O (ModelCheckpoint and the CLI use it)
    building blocks
      config/          the run configuration and the algorithm registry
      algorithms/      pure RL math
      modules/         ready RLModules (GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO, PPO)
      models/          decoders, Hugging Face I/O, LoRA
      packing/         padding-free packed batches: samples laid end to end in rows (plan.packing)
      rollout/         rollout engines (the protocol, the native sampler, vLLM), token logps
      agents/          multi-turn episodes: environments, tools, tool-call parsers
      rewards/         reward functions, the failure-isolated runner, the code sandbox
      data/            prompt sources, loaders, tokenizers
      distributed/     meshes, shardings, processes, placement
      loggers/         metric writers
      utils/           small shared helpers
    the application
      app/             the `rlbolt` command, run folders, plots
      demo/            the built-in demo: its settings, tasks, modules and training
      planning/        `rlbolt plan`: a run built abstractly and compiled for a TPU slice or this host
      callbacks        (the top-level `callbacks/` folder, installed as rlbolt.callbacks)
"""

from __future__ import annotations

import importlib

# name -> module that defines it
_EXPORTS = {
    "Trainer": "rlbolt.trainer",
    "RLModule": "rlbolt.module",
    "Callback": "rlbolt.callback",
    "CallbackList": "rlbolt.callback",
    "Periodic": "rlbolt.callback",
    "BatchPlan": "rlbolt.plan",
    "PlanError": "rlbolt.plan",
    "Batch": "rlbolt.batch",
    "TrainState": "rlbolt.state",
    "StepInfo": "rlbolt.state",
    "ExperienceDock": "rlbolt.producer.dock",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlbolt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
