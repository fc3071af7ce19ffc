"""Causal self-attention over query chunks: the masked half of the score matrix is never built.

Attention in one piece computes, and for the backward keeps, every layer's `[B, heads, T, T]`
scores and softmax, although causal masking zeroes half of them. Here the queries run in chunks
of `chunk` rows, and a chunk of queries `[start, end)` reads keys `[0, end)` only: the later keys
are masked for all of its rows, so its outputs are those of attention in one piece (to float32
rounding) and the chunks together build only the lower triangle, in `chunk`-row steps.

Measured on CPU (gradient of the logps of 8 sequences of 1,056 tokens, 2 layers, 4 heads,
one process, variants taking turns; scratch from XLA's compiled memory analysis):

    one piece        1,003 MB   1.46-1.57 s
    chunks of 256      640 MB   1.17 s
    chunks of 128      591 MB   0.97-1.03 s   (the default)
    chunks of 64       447 MB   1.01 s        (more chunks: more to compile)

Recomputing each chunk in the backward instead of keeping its softmax saved little more here (a
`jax.checkpoint` per chunk: 550 MB at 128, 11% slower; a custom VJP walking the chunks one at a
time behind optimization barriers: the same), so neither is used. A fused attention kernel is
what keeps no score matrix at all.

Looped, not unrolled: a Python loop over the chunks put T / chunk attention blocks per layer
into the program (32 per layer at 4k tokens, 896 for 28 layers), and compile time grew with
them. With more than CHUNK_GROUPS chunks the full chunks are split into CHUNK_GROUPS contiguous
runs; each run is one `jax.lax.map` over its chunks (one compiled body), every chunk of the run
reading the keys up to the run's last row (its later keys exactly masked). The run's staircase
costs a little more than the triangle: about `(1 + 1 / CHUNK_GROUPS) / (1 + chunk / T)` of it
(1.25x at 4k tokens, where one piece is 2x). With CHUNK_GROUPS chunks or fewer (T <= 512 at the
default chunk) the chunks run one by one as before.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# Query rows per chunk when a forward without a cache has more (training and logps forwards).
DEFAULT_QUERY_CHUNK = 128
# Runs of chunks, each one looped body, when there are more chunks than this.
CHUNK_GROUPS = 4


def causal_query_chunks(attend: Callable, q: jnp.ndarray, keys_t: jnp.ndarray, values: jnp.ndarray,
                        visible: jnp.ndarray, chunk: int | None, extra: tuple = (),
                        row_extra: tuple = ()) -> jnp.ndarray:
    """`attend(q, keys_t, values, visible, *extra, *row_extra)` computed over query chunks of at most `chunk` rows.

    Key j must be the token at query position j (self-attention without a cache), so that a
    query never sees a key after its own position.

    Args:
      attend: the attention on one chunk, `(q [B, t, nH, D], keys_t [B, nKV, D, s],
        values [B, nKV, s, D], visible [B, t, s], *extra) -> [B, t, nH * D]`.
      q: [B, T, nH, D] rotated queries.
      keys_t: [B, nKV, D, T] rotated keys, transposed.
      values: [B, nKV, T, D].
      visible: [B, T, T] bool (causal and padding mask).
      chunk: query rows per chunk (static); None or >= T runs `attend` once, unchunked.
      extra: more arrays every chunk reads whole (e.g. a shared prefix's keys, values and mask).
      row_extra: more arrays [N, T, ...] with a row per query, sliced like `q` on axis 1 (e.g. the
        sliding-window mask of the queries against a shared prefix).

    Returns:
      [B, T, nH * D], as `attend(q, keys_t, values, visible, *extra)`.
    """
    t = q.shape[1]
    if chunk is None or t <= chunk:
        return attend(q, keys_t, values, visible, *extra, *row_extra)
    n = t // chunk  # full chunks; a shorter last one follows
    if n <= CHUNK_GROUPS:
        runs = [(i, i + 1) for i in range(n)]
    else:
        sizes = [n // CHUNK_GROUPS + (g < n % CHUNK_GROUPS) for g in range(CHUNK_GROUPS)]
        starts = [sum(sizes[:g]) for g in range(CHUNK_GROUPS)]
        runs = [(a, a + m) for a, m in zip(starts, sizes)]
    outs = [_run(attend, q, keys_t, values, visible, extra, row_extra, a * chunk, b * chunk, chunk)
            for a, b in runs]
    if n * chunk < t:
        outs.append(_run(attend, q, keys_t, values, visible, extra, row_extra, n * chunk, t, t - n * chunk))
    return jnp.concatenate(outs, axis=1)


def _run(attend, q, keys_t, values, visible, extra, row_extra, start, end, chunk):
    """Query rows [start, end) against keys [0, end): one call when it is one chunk, else a
    `jax.lax.map` over its (end - start) / chunk chunks."""
    keys_t, values = keys_t[..., :end], values[:, :, :end]
    rows = (q[:, start:end], visible[:, start:end, :end], *(r[:, start:end] for r in row_extra))
    m = (end - start) // chunk
    if m == 1:
        return attend(rows[0], keys_t, values, rows[1], *extra, *rows[2:])

    def split(a):  # [N, m * chunk, ...] -> [m, N, chunk, ...]
        return jnp.moveaxis(a.reshape(a.shape[0], m, chunk, *a.shape[2:]), 1, 0)

    def one(chunk_rows):
        q_c, visible_c, *row_c = chunk_rows
        return attend(q_c, keys_t, values, visible_c, *extra, *row_c)

    out = jax.lax.map(one, tuple(split(a) for a in rows))  # [m, B, chunk, nH * D]
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], m * chunk, *out.shape[3:])
