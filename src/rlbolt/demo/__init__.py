"""The built-in demo, in one place: what `rlbolt demo` trains.

    config.py       DemoConfig: the demo's settings (config.yaml's `demo` section), JAX-free
    tasks.py        the registry of demo tasks, each with the steps and learning rate that learn it
    digits.py       the digit tasks (copy, reverse, increment) and their module, DigitsGRPO
    agent_tasks.py  the episode tasks (tool, guess): rows, environments, the demo tokenizer
    episodes.py     GRPO on episodes (EpisodeGRPO) and the episode tasks' training (train_demo)

It sits at the application layer, beside `rlbolt.app` (which runs it from the command line): it
imports the modules and the agents, and nothing below the application layer imports it. The
names below load on first use, so reading a demo config imports no JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlbolt.demo.config import DemoConfig, DemoConfigError, is_demo_config
from rlbolt.demo.tasks import DEMO_TASKS, DemoTask, episode_tasks, register_demo_task

_LAZY = {"DIGITS": "digits", "DigitsGRPO": "digits", "demo_rows": "digits", "position_rewards": "digits",
         "EpisodeGRPO": "episodes", "train_demo": "episodes", "demo_module": "episodes"}

__all__ = ["DEMO_TASKS", "DemoConfig", "DemoConfigError", "DemoTask", "episode_tasks", "is_demo_config",
           "register_demo_task", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"rlbolt.demo.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rlbolt.demo' has no attribute {name!r}")
