"""Compaction of finished rows in the decode loop: completions that stop early stop costing.

A decode step computes every row of its batch, including rows that already sampled a stop
token (they are masked, not skipped). Without compaction a micro batch costs as much as its
longest completion times its row count, whatever the mean length. Here, at the start of each
decode segment after the first (`rlbolt.rollout.sampler.decode_segments`), the rows still running are moved to
the front and the segment runs on the smallest of a few static sizes (B, B/2, B/4) that holds
them; its rows are written back in place after the segment.

Every size is compiled into the same executable (one branch of a `lax.switch` per size and
segment), so the number of rows still running never causes a compilation. A compacted row
reads its group's prompt cache through a gathered copy (one prompt row per sample), so the
tokens and log-probabilities are those of the uncompacted loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

# Halvings of the batch a segment may run at: B, B/2, B/4 (each one more compiled copy of the
# decode loop per segment).
MAX_HALVINGS = 2


def compaction_sizes(batch: int, halvings: int = MAX_HALVINGS) -> tuple[int, ...]:
    """The static row counts a segment may run at, largest first: `batch`, then its halvings.

    Halving stops at an odd size: rows are never padded beyond the batch.
    """
    sizes = [batch]
    while len(sizes) <= halvings and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def branch_for(running: jnp.ndarray, sizes: tuple[int, ...]) -> jnp.ndarray:
    """Index into `sizes` (descending) of the smallest size that holds `running` rows."""
    return sum((running <= s).astype(jnp.int32) for s in sizes[1:])


def running_first(done: jnp.ndarray, size: int) -> jnp.ndarray:
    """The row indices of a compacted segment: rows still running first, in order, then finished ones.

    A permutation's first `size` entries, so no row appears twice and writing back is a scatter
    without collisions. Finished rows that fill the rest keep producing pad (they are done).
    """
    return jnp.argsort(done, stable=True)[:size].astype(jnp.int32)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the row and piece sizes compiled shapes use."""
    return 1 << max(0, (n - 1).bit_length())


def take_rows(x, idx: jnp.ndarray):
    """Rows `idx` of every [B, ...] array in the pytree x; scalars (a step, a cache's write index) pass."""
    return jax.tree.map(lambda a: a if a.ndim == 0 else jnp.take(a, idx, axis=0), x)


def put_rows(full, part, idx: jnp.ndarray):
    """`full` with rows `idx` replaced by `part`'s (the inverse of take_rows); scalars are part's."""
    return jax.tree.map(lambda f, p: p if f.ndim == 0 else f.at[idx].set(p), full, part)


def run_compacted(state: Any, done: jnp.ndarray, run: Callable, sizes: tuple[int, ...]) -> Any:
    """Runs `run(state, idx)` on the running rows at the smallest size that holds them.

    Args:
      state: a pytree of per-row [B, ...] arrays and scalars (scalars are not per row).
      done: [B] bool, rows that have finished.
      run: `run(state_subset, idx)` -> the same structure; idx is None for the full batch (rows in
        their original order) or the [size] int32 indices of the subset's rows.
      sizes: `compaction_sizes(B)`.

    Returns:
      The full-size state after the run (the subset's rows written back, its scalars kept).
    """
    def branch(size):
        def go(state):
            if size == sizes[0]:
                return run(state, None)
            idx = running_first(done, size)
            return put_rows(state, run(take_rows(state, idx), idx), idx)
        return go

    if len(sizes) == 1:
        return run(state, None)
    return jax.lax.switch(branch_for(jnp.sum(~done), sizes), [branch(s) for s in sizes], state)
