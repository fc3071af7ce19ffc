"""Decisions and host data shared across processes, so that no process waits for another forever.

Every process of a run must take the same branches around collectives: stop after the same step,
save the same checkpoints, compile the same shapes. Anything decided from process-local facts
(a signal, a wall clock, a file) goes through one of these helpers first. On one process they
return their input without communicating.

All of them are collectives: every process must call them, in the same order. With `group`
(process indices: one process group of a placement across processes, e.g. the training group)
only those processes take part, over a mesh of one device per process of the group: a group
agrees without the processes of another group, which run other programs meanwhile.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


Group = Sequence[int] | None  # process indices taking part (None: the default group, else every process)
_DEFAULT_GROUP: tuple[int, ...] | None = None


def set_default_group(group: Group) -> None:
    """The group a helper called without one agrees in: a fit across process groups sets its own
    group for the fit (so a callback's `any_process` stays inside the training group); None: every process.

    Args:
      group: process indices, or None.
    """
    global _DEFAULT_GROUP
    _DEFAULT_GROUP = None if group is None else tuple(sorted(set(group)))


def default_group() -> tuple[int, ...] | None:
    """The processes a helper called without a group agrees in (None: every process); a checkpoint
    (`CheckpointIO`) saves with them."""
    return _DEFAULT_GROUP


def group_size(group: Group) -> int:
    """How many processes take part: the group's (None: the default group's), or every process's."""
    group = _DEFAULT_GROUP if group is None else group
    return jax.process_count() if group is None else len(set(group))


def _gather(value: np.ndarray, group: Group = None) -> np.ndarray:
    """[processes of the group, *value.shape]: every member's `value`, in process order."""
    group = _DEFAULT_GROUP if group is None else group
    members = None if group is None else tuple(sorted(set(group)))
    if members is None or members == tuple(range(jax.process_count())):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value))
    if jax.process_index() not in members:
        raise RuntimeError(f"process {jax.process_index()} called a collective of the process group {list(members)}, "
                           "which it is not part of")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    firsts = {}
    for d in jax.devices():
        firsts.setdefault(d.process_index, d)
    mesh = Mesh(np.asarray([firsts[p] for p in members], dtype=object), ("processes",))
    local = jax.device_put(np.asarray(value)[None], jax.local_devices()[0])
    stacked = jax.make_array_from_single_device_arrays((len(members), *np.shape(value)),
                                                       NamedSharding(mesh, PartitionSpec("processes")), [local])
    whole = _replicate(NamedSharding(mesh, PartitionSpec()))(stacked)
    return np.asarray(whole.addressable_data(0))


_REPLICATE: dict[Any, Any] = {}


def _replicate(sharding: Any) -> Any:
    """A jitted identity onto `sharding` (one per group mesh: compiled once per shape)."""
    if sharding not in _REPLICATE:
        _REPLICATE[sharding] = jax.jit(lambda x: x, out_shardings=sharding)
    return _REPLICATE[sharding]


def any_process(flag: bool, group: Group = None) -> bool:
    """True on every process (of `group`) when it is True on at least one (e.g. "stop after this step")."""
    if group_size(group) == 1:
        return bool(flag)
    return bool(_gather(np.asarray([int(bool(flag))], np.int32), group).max())


def max_over_processes(values: Sequence[int], group: Group = None) -> list[int]:
    """Element-wise maximum of integer vectors (same length on every process of `group`)."""
    if group_size(group) == 1:
        return [int(v) for v in values]
    return [int(v) for v in _gather(np.asarray(values, np.int64), group).max(axis=0)]


def sum_over_processes(values: dict[str, float], group: Group = None) -> dict[str, float]:
    """Sums of float dicts with the same keys (in any order) on every process (of `group`)."""
    if group_size(group) == 1:
        return dict(values)
    keys = sorted(values)
    gathered = _gather(np.asarray([values[k] for k in keys], np.float64).reshape(1, -1), group)
    return dict(zip(keys, (float(v) for v in gathered.reshape(group_size(group), -1).sum(axis=0))))


def gather_objects(obj: Any, group: Group = None) -> list[Any]:
    """Every process's `obj` (picklable), in process order, on every process (of `group`)."""
    if group_size(group) == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = _gather(np.asarray([payload.size], np.int64), group).reshape(-1)
    # Power-of-two lengths: the gather compiles once per bucket, not once per payload size.
    padded = np.zeros(1 << max(6, (int(sizes.max()) - 1).bit_length()), np.uint8)
    padded[:payload.size] = payload
    gathered = _gather(padded, group).reshape(len(sizes), -1)
    return [pickle.loads(gathered[i, :sizes[i]].tobytes()) for i in range(len(sizes))]


def gather_shares(local: Any, rank: int, size: int, group: Group = None) -> list[Any]:
    """Every data share's `local` object in share order (one per rank: processes that share a
    rank hold equal copies), on every process (of `group`)."""
    if group_size(group) == 1:
        return [local]
    by_rank: dict[int, Any] = {}
    for r, obj in gather_objects((rank, local), group):
        by_rank.setdefault(r, obj)
    if sorted(by_rank) != list(range(size)):
        raise RuntimeError(f"gather_shares: got ranks {sorted(by_rank)}, expected 0..{size - 1}")
    return [by_rank[r] for r in range(size)]
