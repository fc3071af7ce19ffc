"""Throughput: a model-FLOPs estimate per step, MFU where the device's peak is known, and each
stage's share of the step's wall time.

FLOPs follow PaLM's MFU accounting (Chowdhery et al. 2022, arXiv 2204.02311, Appendix B): one
forward pass costs, per token of a sequence of length T,

    2 N + 4 L (H Q) T        N parameters, L layers, H attention heads of width Q

(the weight matmuls, then QK^T and AV without causal halving), and a training pass three times
that. One RL step over samples i with T_i = prompt_i + completion_i real (masked) tokens:

    rollout   sum_i T_i (2 N + 4 L H Q T_i)                 the sampler's forward (prefill + decode)
    logps     logps_forwards x the same                     old / reference logps forwards
    update    num_iterations x 3 x the same                 forward + backward of every pass

Padding is not counted (it is not useful work). Without a model config (no `module.model.config`
with num_layers / num_heads / head_dim) the attention term is left out.

The Trainer already reports `throughput/tokens_per_s` and `throughput/samples_per_s` (completion
tokens and samples over the step's wall time); this callback adds

    throughput/flops_per_s    estimated model FLOPs / time/step
    throughput/mfu            flops_per_s / (peak per device x devices), when the peak is known
    time/share/<stage>        time/<stage> / time/step for rollout, logps, reward, update, data_wait

In sync mode the producer's stages (rollout, logps, reward) run inside `data_wait`; in async mode
they overlap the update, so shares can sum past 1.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rlbolt.callback import Callback
from rlbolt.run_info import RunInfo
from rlbolt.state import StepInfo

# Dense bf16 tensor-core peaks in FLOP/s per device (vendor data sheets, without sparsity).
# Matched in order against `device.device_kind`, so the PCIe H100 comes before the SXM one.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
STAGES = ("rollout", "logps", "reward", "update", "data_wait")


def peak_flops_for(device_kind: str) -> float | None:
    """The table's bf16 peak FLOP/s for a `jax.Device.device_kind`, or None when unknown (e.g. CPU)."""
    kind = device_kind.lower()
    return next((peak for name, peak in PEAK_BF16_FLOPS if name.lower() in kind), None)


def forward_flops(num_params: int, seq_lens: np.ndarray, num_layers: int = 0, attention_width: int = 0) -> float:
    """FLOPs of one forward pass over sequences (PaLM App. B: 2N + 4 L (H Q) T per token).

    Args:
      num_params: N, the model's parameter count.
      seq_lens: [B] real tokens per sequence (prompt + completion).
      num_layers: L (0 leaves the attention term out).
      attention_width: H x Q, query heads times head width.

    Returns:
      sum_i T_i (2 N + 4 L H Q T_i), as a float.
    """
    t = np.asarray(seq_lens, np.float64)
    return float(np.sum(t * (2.0 * num_params + 4.0 * num_layers * attention_width * t)))


def step_flops(num_params: int, seq_lens: np.ndarray, *, num_iterations: int = 1, logps_forwards: int = 0,
               num_layers: int = 0, attention_width: int = 0) -> dict[str, float]:
    """Estimated FLOPs of one RL step, per stage.

    Args:
      num_params: N.
      seq_lens: [B] real prompt + completion tokens of each sample of the global batch.
      num_iterations: passes the update makes over the batch (mu).
      logps_forwards: forward passes the logps stage makes (old and/or reference logps).
      num_layers: L (0: no attention term).
      attention_width: H x Q.

    Returns:
      {"rollout", "logps", "update", "total"} in FLOPs.
    """
    forward = forward_flops(num_params, seq_lens, num_layers, attention_width)
    out = {"rollout": forward, "logps": logps_forwards * forward, "update": 3.0 * num_iterations * forward}
    out["total"] = sum(out.values())
    return out


class Throughput(Callback):
    """Adds `throughput/flops_per_s`, `throughput/mfu` and `time/share/*` to each step's metrics.

    It runs before MetricsLogger and ProgressBar (`order = -20`), whatever the list order.

    Args:
      peak_flops: peak FLOP/s of one device; None looks the device kind up in `PEAK_BF16_FLOPS`
        (H100, H200, A100), and on an unknown device (CPU) no MFU is reported.
      logps_forwards: forward passes of the logps stage; None infers them from the batch:
        one when it has `ref_logps`, plus one when `num_iterations > 1` (old logps).
      num_params: N; None counts the elements of `TrainState.params`.

    Attributes:
      peak: the total peak FLOP/s used for MFU (per device x device count), or None.
      last_flops: the last step's `step_flops` result.
    """

    order = -20  # adds its metrics before the writers run

    def __init__(self, peak_flops: float | None = None, logps_forwards: int | None = None, num_params: int | None = None):
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"Throughput(peak_flops={peak_flops!r}) must be positive FLOP/s per device (or None)")
        if logps_forwards is not None and logps_forwards < 0:
            raise ValueError(f"Throughput(logps_forwards={logps_forwards!r}) must be >= 0 (or None to infer)")
        self.peak_flops, self.logps_forwards, self.num_params = peak_flops, logps_forwards, num_params
        self.peak: float | None = None
        self.last_flops: dict[str, float] = {}
        self._shape: tuple[int, int] = (0, 0)

    def on_fit_start(self, run: RunInfo, state) -> None:
        per_device = self.peak_flops or peak_flops_for(jax.devices()[0].device_kind)
        self.peak = per_device * jax.device_count() if per_device else None
        if self.num_params is None:
            self.num_params = int(sum(np.size(x) for x in jax.tree.leaves(state.params)))
        self._shape = attention_shape(run.card.model_config if run.card is not None else None)

    def step_metrics(self, run: RunInfo, info: StepInfo) -> dict[str, float]:
        m, batch, out = info.metrics, info.batch, {}
        step_s = m.get("time/step", 0.0)
        for stage in STAGES:
            if f"time/{stage}" in m and step_s > 0:
                out[f"time/share/{stage}"] = m[f"time/{stage}"] / step_s
        if batch is None or step_s <= 0:
            return out
        iterations = run.plan.num_iterations
        forwards = self.logps_forwards
        if forwards is None:
            forwards = int("ref_logps" in batch) + int(iterations > 1)
        self.last_flops = step_flops(self.num_params, sequence_lengths(batch), num_iterations=iterations,
                                     logps_forwards=forwards, num_layers=self._shape[0], attention_width=self._shape[1])
        out["throughput/flops_per_s"] = self.last_flops["total"] / step_s
        if self.peak:
            out["throughput/mfu"] = out["throughput/flops_per_s"] / self.peak
        return out


def sequence_lengths(batch: Any) -> np.ndarray:
    """[N] real prompt + completion tokens per sample (masks when present, else the padded widths)."""
    def count(mask: str, ids: str) -> np.ndarray:
        if mask in batch:
            return np.asarray(batch[mask]).sum(axis=1)
        return np.full(batch.num_samples, np.asarray(batch[ids]).shape[1]) if ids in batch else np.zeros(batch.num_samples)

    return count("prompt_mask", "prompt_ids") + count("completion_mask", "completion_ids")


def attention_shape(config: Any) -> tuple[int, int]:
    """(L, H x Q) from a `ModelConfig` (num_layers, num_heads, head_dim); (0, 0) when unknown (None)."""
    try:
        return int(config.num_layers), int(config.num_heads) * int(config.head_dim)
    except (AttributeError, TypeError):
        return 0, 0
