"""Validation over held-out prompts: `Trainer.validate`'s loop, each process on its share of the rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rlbolt.batch import Batch
from rlbolt.distributed import state as placement, sum_over_processes
from rlbolt.producer import STAGE_ROLES


def run_validation(trainer: Any, params: Any, val_data: Sequence[dict], step: int) -> dict[str, float]:
    """`trainer.module.validation_step` over `val_data` in batches of `trainer.val_batch_size`.

    Args:
      trainer: the Trainer (its module, seed, val_batch_size, sharding and timeline).
      params: the parameters to validate.
      val_data: the rows.
      step: the global step just completed (the timeline event is the 0-based step it follows).

    Returns:
      `val/*` means over every row of every process (sample-weighted).
    """
    totals: dict[str, float] = {}
    count, began = 0, trainer.timeline.clock()
    for start in range(0, len(val_data), trainer.val_batch_size):
        stop = min(start + trainer.val_batch_size, len(val_data))
        keys = np.asarray(jax.random.split(jax.random.PRNGKey(trainer.seed + 7919), stop - start))
        # This process's rows (all of them on one process); weight 0 for a filler row.
        indices, weight = placement.validation_rows(start, stop, trainer.sharding.share)
        rows = [{**val_data[i], "prompt_index": i} for i in indices]
        batch = Batch.from_rows(rows).with_columns(sample_keys=keys[np.asarray(indices) - start])
        for k, v in trainer.module.validation_step(params, batch).items():
            totals[k] = totals.get(k, 0.0) + float(v) * weight
        count += weight
    totals = sum_over_processes({**totals, "__count__": float(count)})  # every process's rows
    count = totals.pop("__count__")
    metrics = {(k if k.startswith("val/") else f"val/{k}"): v / max(count, 1) for k, v in totals.items()}
    trainer.timeline.record("validate", step - 1, began, trainer.timeline.clock(), samples=count,
                            role=STAGE_ROLES["validate"])
    return metrics
