"""The demo's settings (`DemoConfig`): what `rlbolt demo` runs and writes to config.yaml.

Kept apart from the demo's modules so the command line can read defaults and validate a
config.yaml without importing JAX. The tasks and their defaults are `rlbolt.demo.tasks`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from rlbolt.demo.tasks import DEMO_TASKS, episode_tasks


def is_demo_config(data: dict[str, Any]) -> bool:
    """True when a config.yaml mapping was written by `rlbolt demo` (a single `demo` section)."""
    return set(data) == {"demo"}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything the demo run depends on (written to the run directory as config.yaml).

    Attributes:
      seed: seeds the model init, the prompts and every sampled token.
      max_steps: global steps to train (None: the task's, `rlbolt.demo.tasks`, filled in by `resolved()`).
      num_digits: digits per prompt (= completion tokens).
      num_prompts: size of the synthetic training set (None: the task's, `demo_num_prompts`:
        2,000 digit rows; for tool and guess a fresh row for every prompt the run draws).
      prompts_per_step: prompts per global step.
      num_generations: completions per prompt (the GRPO group size G).
      learning_rate: AdamW learning rate (None: the task's, `rlbolt.demo.tasks`, filled in by `resolved()`).
      clip: PPO clip range epsilon.
      temperature: sampling temperature.
      hidden_size: model width (2 layers, 4 query / 2 kv heads).
      checkpoint_every: save a checkpoint every this many steps (None: only at the end).
      task: a registered demo task (`rlbolt.demo.tasks`): "copy", "reverse" or "increment" (digit
        tasks); "tool" (the answer is a value only a lookup tool knows) or "guess" (guess a number
        from higher/lower replies): multi-turn episodes (`rlbolt.demo.agent_tasks`).
      lora_rank: None trains every parameter; r trains only LoRA adapters of rank r (alpha 2r) on
        all seven projections of the frozen base (`rlbolt.models.lora`).
      base_run: start from the policy of another demo run's latest checkpoint (same hidden_size
        and num_digits) instead of a random model, e.g. a copy-trained base that LoRA then adapts
        to "reverse". A random base cannot be adapted far: its frozen lm_head (std 0.02) after
        the frozen final norm caps every logit near 1.3, so no digit gets much above p = 0.3.
    """

    seed: int = 0
    max_steps: int | None = None
    num_digits: int = 4
    num_prompts: int | None = None
    prompts_per_step: int = 16
    num_generations: int = 8
    learning_rate: float | None = None
    clip: float = 0.2
    temperature: float = 1.0
    hidden_size: int = 64
    checkpoint_every: int | None = None
    task: str = "copy"
    lora_rank: int | None = None
    base_run: str | None = None

    def __post_init__(self):
        # max_steps / learning_rate stay None when not given: `resolved()` fills in the task's, so a
        # copy made with dataclasses.replace(config, task=...) gets the new task's defaults.
        if self.task not in DEMO_TASKS:
            raise DemoConfigError(f"demo.task={self.task!r}; allowed: {list(DEMO_TASKS.names())}")
        if self.task in episode_tasks() and (self.lora_rank is not None or self.base_run is not None):
            digit_tasks = [t for t in DEMO_TASKS.names() if t not in episode_tasks()]
            raise DemoConfigError(f"demo.task={self.task}: lora_rank and base_run apply to the digit tasks "
                                  f"{digit_tasks}; leave them out")
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _FIELD_KINDS[f.name]
            ok = (value is None and f.name in _OPTIONAL) or (
                isinstance(value, kind) and not isinstance(value, bool)) or (kind is float and isinstance(value, int)
                                                                            and not isinstance(value, bool))
            if not ok:
                raise DemoConfigError(f"demo.{f.name}={value!r} must be of type {kind.__name__}")
        for name in ("max_steps", "num_digits", "num_prompts", "prompts_per_step", "num_generations", "hidden_size",
                     "lora_rank"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise DemoConfigError(f"demo.{name}={getattr(self, name)} must be >= 1")
        if self.num_generations < 2:
            raise DemoConfigError(f"demo.num_generations={self.num_generations}: GRPO needs >= 2 samples per group")
        if self.hidden_size % 4:
            raise DemoConfigError(f"demo.hidden_size={self.hidden_size} must be a multiple of 4 (4 heads)")

    def resolved(self) -> DemoConfig:
        """This config with every unset field (None) that has a task default filled in from
        the task's registration (`rlbolt.demo.tasks`): what a run trains with, and what its config.yaml records.

        A field given explicitly (`DemoConfig(max_steps=50)`, `--max-steps 50`) is kept.
        """
        task = DEMO_TASKS[self.task]
        steps, lr = task.steps, task.learning_rate
        steps = steps if self.max_steps is None else self.max_steps
        num_prompts = (demo_num_prompts(self.task, steps, self.prompts_per_step) if self.num_prompts is None
                       else self.num_prompts)
        return dataclasses.replace(self, max_steps=steps, num_prompts=num_prompts,
                                   learning_rate=lr if self.learning_rate is None else self.learning_rate)

    def to_dict(self) -> dict[str, Any]:
        """The config as a `{"demo": {...}}` mapping (the config.yaml layout of a demo run; unset
        fields are written as null, so `from_dict(to_dict())` gives the same config back: a run
        writes `resolved().to_dict()`)."""
        return {"demo": dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DemoConfig:
        """Reads the `{"demo": {...}}` mapping written by `to_dict`.

        Raises:
          DemoConfigError: an unknown key (the closest known one is suggested) or a bad value.
        """
        fields = [f.name for f in dataclasses.fields(cls)]
        section = data.get("demo") or {}
        if not isinstance(section, dict):
            raise DemoConfigError(f"demo section must be a mapping of key: value, got {section!r}")
        for key in section:
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise DemoConfigError(f"unknown key demo.{key}{hint}; allowed: {fields}")
        return cls(**section)


class DemoConfigError(ValueError):
    """A demo setting is unknown or out of range (the message names it and the allowed values)."""


def demo_num_prompts(task: str, max_steps: int, prompts_per_step: int) -> int:
    """How many rows a demo run draws its prompts from when `num_prompts` is unset: 2,000 for the
    digit tasks; for the agent tasks one fresh row per prompt the run consumes (`max_steps *
    prompts_per_step`, at least 64), the data the tasks' figures were measured on (from 2,000 rows
    repeated, `rlbolt demo --task tool` stalled near 0.87 instead of passing 0.99)."""
    if task in episode_tasks():
        return max(max_steps * prompts_per_step, 64)
    return 2000


_OPTIONAL = ("max_steps", "num_prompts", "learning_rate", "checkpoint_every", "lora_rank", "base_run")  # None allowed
_FIELD_KINDS = {"seed": int, "max_steps": int, "num_digits": int, "num_prompts": int, "prompts_per_step": int,
                "num_generations": int, "learning_rate": float, "clip": float, "temperature": float,
                "hidden_size": int, "checkpoint_every": int, "task": str, "lora_rank": int, "base_run": str}
