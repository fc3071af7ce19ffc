"""A step's metrics, assembled in one place.

    producer thread   measures its stages: time/<stage>, the dock's waits and rates, refills,
                      values hooks logged with RLModule.log        (ProducedStep.metrics)
    main thread       measures the updates: loss & co. (means over the step's updates),
                      staleness, time/update, time/data_wait, time/step
    step_metrics()    joins them with what the batch says (rewards, advantages, lengths) and the
                      throughput; the Trainer then asks each callback for its own additions
                      (`Callback.step_metrics`) before any `on_step_end` sees the final, read-only
                      dict in StepInfo.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rlbolt.batch import Batch


def step_metrics(batch: Batch, producer: Mapping[str, float], update: Mapping[str, float], staleness: np.ndarray, *,
                 data_wait_s: float, step_s: float) -> dict[str, float]:
    """Every metric of one step except the callbacks' additions.

    Args:
      batch: the trained global batch (host columns: rewards, advantages, completion_mask).
      producer: what the producer measured (ProducedStep.metrics).
      update: the update metrics, averaged over the step's updates, and `time/update`.
      staleness: [updates x mini batch] policy versions each trained sample lagged.
      data_wait_s: how long the main thread waited for the step's batch.
      step_s: the step's wall time from the end of the previous step (waiting included).
    """
    out = {**update, **batch_metrics(batch), **producer}
    out.update({"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max()),
                "time/data_wait": data_wait_s, "time/step": step_s})
    tokens = float(np.asarray(batch["completion_mask"]).sum())
    out["throughput/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
    out["throughput/samples_per_s"] = batch.num_samples / step_s if step_s > 0 else 0.0
    return out


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
