"""The hand-off between producer stages: what a hook may return.

A producer hook gets a batch and returns it with columns added. It must return one row per
sample (only `on_advantage` may drop samples, keeping their order, and its batch carries
`dock_index` so the producer knows which survived) and must not change a column an earlier
stage wrote: the ExperienceDock refuses double writes, and a silent rewrite would be lost.
Each check fails with one line naming the hook, the column and the fix.

With several processes each dock holds its process's share of every round; `gather_round`
makes the whole round (every share, in share order) for on_advantage, and `step_rows` the
whole step's kept rows for training.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbolt.batch import Batch, register_column
from rlbolt.distributed.agree import gather_shares

INDEX_COLUMN = register_column(
    "dock_index", "[N]", "int64", "the sample's slot in the dock", by=__name__)  # on_advantage's batch carries it, so the kept samples are known
_HOOKS = {"rollout": "on_rollout", "logps": "compute_logps", "reward": "on_reward", "advantage": "on_advantage"}


def with_rewards(batch: Batch) -> Batch:
    """`batch` when `on_reward` added a `rewards` [N] column (else one line saying so)."""
    if "rewards" not in batch or np.shape(batch["rewards"]) != (batch.num_samples,):
        raise ValueError(f"on_reward must add a `rewards` column of shape [{batch.num_samples}]; got "
                         f"{list(np.shape(batch['rewards'])) if 'rewards' in batch else 'none'}")
    return batch


def kept_samples(out: Batch, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept indices, their positions in idx) from on_advantage's output."""
    if INDEX_COLUMN not in out:
        if out.num_samples == len(idx):
            return idx, np.arange(len(idx))
        raise ValueError(f"on_advantage dropped samples and the {INDEX_COLUMN!r} column with them; keep the columns "
                         "it receives (drop samples with batch.select)")
    kept = np.asarray(out[INDEX_COLUMN]).astype(np.int64)
    where = {i: p for p, i in enumerate(idx.tolist())}
    positions = np.array([where.get(i, -1) for i in kept.tolist()], np.int64)
    if (positions < 0).any() or (np.diff(positions) <= 0).any():
        raise ValueError(f"on_advantage returned samples that are not a subset of its input in input order "
                         f"({INDEX_COLUMN}={kept.tolist()[:8]}...); it may drop samples, not add or reorder them")
    return kept, positions


def added_columns(stage: str, before: Batch, after: Batch, positions: np.ndarray) -> dict[str, Any]:
    """The columns a hook added; a hook must not change the ones it received."""
    hook = _HOOKS[stage]
    if after.num_samples != len(positions):
        raise ValueError(f"{hook} returned {after.num_samples} samples for {before.num_samples}; it must return one "
                         "row per sample (only on_advantage may drop samples)")
    for name in after:
        if name in before and not _same(np.asarray(before[name])[positions] if len(positions) != before.num_samples
                                        else before[name], after[name]):
            raise ValueError(f"{hook} changed column {name!r}, which an earlier stage wrote; a stage adds columns and "
                             "leaves the ones it received as they are (write the result under a new name)")
    return {name: after[name] for name in after if name not in before}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == object:  # selecting rows copies references: unchanged items are the same objects
        return all(x is y or _same_item(x, y) for x, y in zip(a.ravel(), b.ravel()))
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _same_item(x: Any, y: Any) -> bool:
    try:
        return bool(x == y)
    except ValueError:  # arrays inside an object column
        return bool(np.array_equal(np.asarray(x), np.asarray(y)))


def gather_round(local: Batch, share: Any) -> Batch:
    """Every data share's rows of a round, in share order, on every process (a collective)."""
    shares = gather_shares(dict(local), share.rank, share.size, getattr(share, "processes", None))  # its group only
    return Batch.concat([Batch(cols) for cols in shares])


def step_rows(gathered: list[tuple[np.ndarray, Batch]], writes: list[tuple[dict[str, Any], np.ndarray]]) -> Batch:
    """The step's training rows: per round, the kept rows (positions in the gathered round) of
    the gathered batch with the columns on_advantage added."""
    parts = [batch.select(kept).with_columns(columns) for (_, batch), (columns, kept) in zip(gathered, writes)
             if len(kept)]
    return Batch.concat(parts)
