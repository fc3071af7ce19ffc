"""`demo.task`: the tasks `rlbolt demo` trains, each registered once with what learns it.

A task is registered with the figures it learns with on the CI machine (the steps and learning
rate a config leaves None takes: `DemoConfig.resolved`) and what it is made of, as importable
references so that this module, and the command line reading a demo config, stay free of JAX:

- a digit task (`target`): `fn(digits: str) -> str`, the completion a prompt "<digits>=" asks
  for; the digits module (`rlbolt.demo.digits.DigitsGRPO`) trains it;
- an episode task (`rows`, `env`, `limits`): `rows(num_rows, seed) -> list[dict]`, the
  environment factory `env(row)`, and `run_episodes`' limits; GRPO on episodes trains it
  (`rlbolt.demo.episodes`).

Adding a task touches this file (and the one holding its code).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from rlbolt.utils.registry import Registry


@dataclasses.dataclass(frozen=True)
class DemoTask:
    """A registered demo task.

    Attributes:
      steps: global steps that learn it (measured; `TASK_DEFAULTS` before).
      learning_rate: AdamW learning rate it learns with.
      target: a digit task's `'module:function'` mapping the prompt digits to the target.
      rows: an episode task's `'module:function'` making its rows.
      env: an episode task's `'module:function'` environment factory.
      limits: an episode task's max_turns, max_turn_tokens, max_total_tokens.
    """

    steps: int
    learning_rate: float
    target: str | None = None
    rows: str | None = None
    env: str | None = None
    limits: dict = dataclasses.field(default_factory=dict)

    @property
    def episodes(self) -> bool:
        """Whether the task is multi-turn episodes (else a digit task)."""
        return self.env is not None

    def load(self, part: str) -> Any:
        """The object `target`, `rows` or `env` names, imported."""
        module, _, name = getattr(self, part).partition(":")
        return getattr(importlib.import_module(module), name)


DEMO_TASKS: Registry[DemoTask] = Registry("demo task", "demo.task")


def register_demo_task(name: str, task: DemoTask) -> DemoTask:
    """Registers `task` as `demo.task: name` (`rlbolt demo --task name`).

    Raises:
      ValueError: the task is neither a digit task (target) nor an episode task (rows, env,
        limits), or the name is taken.
    """
    if (task.target is None) == (task.env is None) or (task.env is not None and (task.rows is None or not task.limits)):
        raise ValueError(f"demo task {name!r} needs either target= (a digit task) or rows=, env= and limits= "
                         "(an episode task)")
    return DEMO_TASKS.register(name, task, owner=f"{__name__}.{name}")


def episode_tasks() -> tuple[str, ...]:
    """The registered multi-turn tasks (tool, guess)."""
    return tuple(n for n in DEMO_TASKS.names() if DEMO_TASKS[n].episodes)


_DIGITS = "rlbolt.demo.digits"
_AGENTS = "rlbolt.demo.agent_tasks"
register_demo_task("copy", DemoTask(300, 5e-4, target=f"{_DIGITS}:copy_target"))
register_demo_task("reverse", DemoTask(300, 5e-4, target=f"{_DIGITS}:reverse_target"))
register_demo_task("increment", DemoTask(300, 5e-4, target=f"{_DIGITS}:increment_target"))
register_demo_task("tool", DemoTask(600, 1e-3, rows=f"{_AGENTS}:lookup_rows", env=f"{_AGENTS}:lookup_env",
                                    limits={"max_turns": 3, "max_turn_tokens": 2, "max_total_tokens": 12}))
register_demo_task("guess", DemoTask(600, 1e-3, rows=f"{_AGENTS}:guess_rows", env=f"{_AGENTS}:guess_env",
                                     limits={"max_turns": 4, "max_turn_tokens": 2, "max_total_tokens": 20}))
