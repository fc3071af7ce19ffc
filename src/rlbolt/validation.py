"""Validation over held-out prompts: `Trainer.validate`'s loop, each process on its share of the rows."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlbolt.batch import Batch
from rlbolt.distributed import layout, sum_over_processes
from rlbolt.producer import STAGE_ROLES
from rlbolt.timeline import Timeline


def run_validation(validation_step: Callable[..., dict[str, float]], params: Any, val_data: Sequence[dict], *,
                   batch_size: int, seed: int, share: Any, timeline: Timeline, step: int,
                   options: dict[str, Any] | None = None) -> dict[str, float]:
    """`validation_step(params, batch, **options)` over `val_data` in batches of `batch_size`.

    Args:
      validation_step: the module's hook.
      params: the parameters to validate.
      val_data: the rows.
      batch_size: prompts per validation batch.
      seed: the run's seed (validation keys derive from it: the same keys at every validation).
      share: this process's `DataShare` (its rows of each batch).
      timeline: where the "validate" event is recorded.
      step: the global step just completed (the timeline event is the 0-based step it follows).
      options: keyword arguments for every `validation_step` call (e.g. `num_samples`).

    Returns:
      `val/*` means over every row of every process (sample-weighted).
    """
    totals: dict[str, float] = {}
    count, began = 0, timeline.clock()
    for start in range(0, len(val_data), batch_size):
        stop = min(start + batch_size, len(val_data))
        keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed + 7919), stop - start))
        # This process's rows (all of them on one process); weight 0 for a filler row.
        indices, weight = layout.validation_rows(start, stop, share)
        rows = [{**val_data[i], "prompt_index": i} for i in indices]
        batch = Batch.from_rows(rows).with_columns(sample_keys=keys[np.asarray(indices) - start])
        for k, v in validation_step(params, batch, **(options or {})).items():
            totals[k] = totals.get(k, 0.0) + float(v) * weight
        count += weight
    totals = sum_over_processes({**totals, "__count__": float(count)})  # every process's rows
    count = totals.pop("__count__")
    metrics = {(k if k.startswith("val/") else f"val/{k}"): v / max(count, 1) for k, v in totals.items()}
    timeline.record("validate", step - 1, began, timeline.clock(), samples=count, role=STAGE_ROLES["validate"])
    return metrics


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` takes the keyword argument `name` (named, or through **kwargs)."""
    parameters = inspect.signature(fn).parameters.values()
    return any(p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) or p.kind == p.VAR_KEYWORD
               for p in parameters)


@dataclasses.dataclass(frozen=True)
class ValidationSchedule:
    """When a fit validates: before the first step (`at_start`, a fresh run only), after every
    `every_n_steps`-th step, and after the last step unless that step was just validated; never
    without validation rows.

    Attributes:
      has_rows: the fit was given validation rows.
      every_n_steps: the period (None: only at the end).
      at_start: also validate the starting weights (step 0).
      first_step: the step the fit starts from (a resume starts past 0).
    """

    has_rows: bool
    every_n_steps: int | None
    at_start: bool
    first_step: int

    def before_first_step(self) -> bool:
        return self.has_rows and self.at_start and self.first_step == 0

    def after_step(self, step: int) -> bool:
        return self.has_rows and bool(self.every_n_steps) and step % self.every_n_steps == 0

    def after_last_step(self, step: int) -> bool:
        return self.has_rows and step > self.first_step and not self.after_step(step)


@dataclasses.dataclass(frozen=True)
class ScheduledValidation:
    """The Trainer's own validation (`val_data`, `val_every_n_steps`, `val_at_start`) as three hooks
    of its fit loop, so the loop calls them without deciding anything: `on_train_start` (inside
    fit's signal and error handling, before the producer's threads start), `on_step_end` (after
    every callback's `on_step_end`) and `on_train_end` (after the last step, before `on_fit_end`;
    not after a signal or an exception).

    Attributes:
      schedule: when to validate.
      rows: the validation rows (None: never validates).
      validate: `(params, rows, step) -> metrics` (`Trainer.validate`).
    """

    schedule: ValidationSchedule
    rows: Sequence[dict] | None
    validate: Callable[[Any, Sequence[dict], int], dict[str, float]]

    def on_train_start(self, state) -> None:
        if self.schedule.before_first_step():
            self.validate(state.params, self.rows, state.step)

    def on_step_end(self, state) -> None:
        if self.schedule.after_step(state.step):
            self.validate(state.params, self.rows, state.step)

    def on_train_end(self, state) -> None:
        if self.schedule.after_last_step(state.step):
            self.validate(state.params, self.rows, state.step)
