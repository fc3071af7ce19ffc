"""Metrics of every step from the produced batch: the producer's (rewards, advantages, lengths)
and the Trainer's (throughput)."""

from __future__ import annotations

import numpy as np

from rlbolt.batch import Batch


def add_throughput(metrics: dict[str, float], batch: Batch) -> None:
    """Rates over the step's wall time (from the end of the previous step: waiting included)."""
    step_s = metrics["time/step"]
    tokens = float(np.asarray(batch["completion_mask"]).sum())
    metrics["throughput/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
    metrics["throughput/samples_per_s"] = batch.num_samples / step_s if step_s > 0 else 0.0


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Standard metrics of a produced global batch (host NumPy)."""
    out: dict[str, float] = {}
    rewards = np.asarray(batch["rewards"], np.float64)
    out["reward/mean"], out["reward/std"] = float(rewards.mean()), float(rewards.std())
    adv = np.asarray(batch["advantages"], np.float64)
    out.update({"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()),
                "advantage/min": float(adv.min()), "advantage/max": float(adv.max())})
    mask = np.asarray(batch["completion_mask"], bool)
    lengths = mask.sum(axis=1)
    out["response_length/mean"] = float(lengths.mean())
    out["response_length/max"] = float(lengths.max())
    # A completion "clipped" by the length budget still has its last slot filled.
    out["response_length/clip_ratio"] = float(mask[:, -1].mean())
    return out
