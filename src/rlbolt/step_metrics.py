"""Metrics the Trainer adds to every step from the produced batch."""

from __future__ import annotations

import numpy as np

from rlbolt.batch import Batch


def add_throughput(metrics: dict[str, float], batch: Batch) -> None:
    """Rates over the step's wall time (from the end of the previous step: waiting included)."""
    step_s = metrics["time/step"]
    tokens = float(np.asarray(batch["completion_mask"]).sum())
    metrics["throughput/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
    metrics["throughput/samples_per_s"] = batch.num_samples / step_s if step_s > 0 else 0.0
