"""Decisions and host data shared across processes, so that no process waits for another forever.

Every process of a run must take the same branches around collectives: stop after the same step,
save the same checkpoints, compile the same shapes. Anything decided from process-local facts
(a signal, a wall clock, a file) goes through one of these helpers first. On one process they
return their input without communicating.

All of them are collectives: every process must call them, in the same order.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def _gather(value: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value))


def any_process(flag: bool) -> bool:
    """True on every process when it is True on at least one (e.g. "stop after this step")."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(_gather(np.asarray([int(bool(flag))], np.int32)).max())


def max_over_processes(values: Sequence[int]) -> list[int]:
    """Element-wise maximum of integer vectors (same length on every process)."""
    if jax.process_count() == 1:
        return [int(v) for v in values]
    return [int(v) for v in _gather(np.asarray(values, np.int64)).max(axis=0)]


def sum_over_processes(values: dict[str, float]) -> dict[str, float]:
    """Sums of float dicts with the same keys (in any order) on every process."""
    if jax.process_count() == 1:
        return dict(values)
    keys = sorted(values)
    gathered = _gather(np.asarray([values[k] for k in keys], np.float64).reshape(1, -1))
    return dict(zip(keys, (float(v) for v in gathered.reshape(jax.process_count(), -1).sum(axis=0))))


def gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in process order, on every process."""
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = _gather(np.asarray([payload.size], np.int64)).reshape(-1)
    # Power-of-two lengths: the gather compiles once per bucket, not once per payload size.
    padded = np.zeros(1 << max(6, (int(sizes.max()) - 1).bit_length()), np.uint8)
    padded[:payload.size] = payload
    gathered = _gather(padded).reshape(len(sizes), -1)
    return [pickle.loads(gathered[i, :sizes[i]].tobytes()) for i in range(len(sizes))]


def gather_shares(local: Any, rank: int, size: int) -> list[Any]:
    """Every data share's `local` object in share order (one per rank: processes that share a
    rank hold equal copies), on every process."""
    if jax.process_count() == 1:
        return [local]
    by_rank: dict[int, Any] = {}
    for r, obj in gather_objects((rank, local)):
        by_rank.setdefault(r, obj)
    if sorted(by_rank) != list(range(size)):
        raise RuntimeError(f"gather_shares: got ranks {sorted(by_rank)}, expected 0..{size - 1}")
    return [by_rank[r] for r in range(size)]
