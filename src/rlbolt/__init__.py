"""rlbolt: a Lightning-style trainer for RL post-training of language models in JAX.

The main classes are importable from the top level (loaded on first use, so `rlbolt --help`
does not pay for importing JAX):

    from rlbolt import Trainer, RLModule, Callback, BatchPlan

Layout: the core (trainer, producer, prefetch, weights, update, module, callback, state, batch,
plan, fit_checks, timeline) sits in this folder, with the ExperienceDock in `rlbolt.dock`; the
building blocks in subpackages (algorithms, modules, models, rollout, rewards, data, loggers);
the application layer (the `rlbolt` command, config files, run directories, the demo, plots)
in `rlbolt.app`; small shared helpers in `rlbolt.utils`.
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
    "ExperienceDock": "rlbolt.dock",
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
