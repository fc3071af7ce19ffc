"""Validation over held-out prompts: `Trainer.validate`'s loop, each process on its share of the rows.

When a fit validates is the `Evaluation` callback's business (`fit(val_data=...)` installs one)."""

from __future__ import annotations

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
