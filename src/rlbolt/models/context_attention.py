"""Ring attention: causal self-attention of a sequence split over the mesh axis `context`.

With `mesh.context = n > 1` the token axis of a cache-free forward (training, log-prob forwards)
is cut into n pieces, one per device of each context group; everything but attention is
per-token, so only attention needs the other pieces. `ring_attention` runs under `jax.shard_map`:
each device keeps its queries and passes its keys and values (with their segment ids and slots)
around the ring with `jax.lax.ppermute`, n steps, merging each block into a flash-style online
softmax in float32 (running max, denominator and weighted sum). In each step the device's
queries run in chunks of at most QUERY_CHUNK rows, each a `jax.checkpoint` (the backward
recomputes a chunk's scores instead of keeping them), so a device holds one (chunk x T/n) block
of scores at a time and keeps only the running (o, m, l) of each step for the backward.

Why a ring and not all-gathered keys/values: an all-gather is simpler and as fast for small n
with grouped-query K/V, but it materialises the whole sequence's keys and values on every device
at once in the forward and moves them in one burst; the ring moves one piece per step (which XLA
can overlap with the step's products) and its forward holds one piece at a time. The backward
keeps each step's piece and running (o, m, l) (the whole sequence's K/V per device: linear in T,
not divided by n; benchmarks/RESULTS.md, Context parallelism).

Load balance for causal masks: the sequence is cut into 2n chunks and device i holds chunks i
and 2n-1-i (`balanced_order`: a permutation of the token axis applied before the layers and
undone on their output, `rlbolt.models.context_parallel`), so every device owns as many early
as late queries. The masks always use each token's ORIGINAL slot (`slots`), and RoPE the
original positions, so the permutation changes nothing but the order of the rows. In that order
(`balanced=True`) every step after the first has exactly half of its block visible (keys from an
earlier device: all queries against their first chunk; from a later device: the second chunk of
queries against all of them) and computes only that half, under `jax.lax.cond` on the device's
index: every device does the same work at every step.

Masks are structural, as the fused kernels': causal on slots, AND the same nonzero segment
(`segment_ids` [B, T], 0 = padding; a left-padded row is segment 1 behind its pads, packed rows
number their samples), AND for sliding layers `q - k < window` on slots. A query with no
visible key (a padding query) gets zeros; its output is masked downstream.

Each block's product runs through XLA (einsum), also when `model.attention: flash` chose a fused
kernel: with context > 1 every layer runs this ring, splash/cuDNN inside the ring is future work.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rlbolt.models.attention import MASK_VALUE, scaled_scores

CONTEXT_AXIS = "context"
# A ring step's queries run in chunks of at most this many rows, each a `jax.checkpoint`: a device
# holds one (chunk x T/n) block of scores at a time, in the backward too.
QUERY_CHUNK = 512
MIN_QUERY_CHUNK = 128


def context_ways(mesh: Any) -> int:
    """The size of `mesh`'s `context` axis (1 for None or a mesh without one)."""
    if mesh is None or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


def padded_length(length: int, ways: int) -> int:
    """`length` rounded up to a multiple of 2 * ways (the 2n load-balanced chunks), and further to
    a multiple of ways * MIN_QUERY_CHUNK when a device's piece is longer than QUERY_CHUNK and has no
    divisor in [MIN_QUERY_CHUNK, QUERY_CHUNK] (so `query_chunk` finds one)."""
    step = 2 * ways
    padded = -(-length // step) * step
    if query_chunk(padded // ways) is None:
        step = ways * MIN_QUERY_CHUNK
        padded = -(-length // step) * step
    return padded


def query_chunk(piece: int) -> int | None:
    """The query rows per chunk of a device's piece of `piece` tokens: all of them up to QUERY_CHUNK,
    else the largest divisor in [MIN_QUERY_CHUNK, QUERY_CHUNK] (None when there is none)."""
    if piece <= QUERY_CHUNK:
        return piece
    return next((c for c in range(QUERY_CHUNK, MIN_QUERY_CHUNK - 1, -1) if piece % c == 0), None)


def balanced_order(length: int, ways: int) -> np.ndarray:
    """The token permutation [length] that gives device i of the ring chunks i and 2n-1-i.

    Args:
      length: T, a multiple of 2 * ways.
      ways: n, the context axis size.

    Returns:
      int32 original slots in the new order: device i's piece is `order[i*T/n:(i+1)*T/n]`.

    Raises:
      ValueError: length is not a multiple of 2 * ways.
    """
    if length % (2 * ways):
        raise ValueError(f"balanced_order: length {length} is not a multiple of 2 x mesh.context = {2 * ways}; "
                         "pad it first (padded_length)")
    chunk = length // (2 * ways)
    pieces = [np.arange(c * chunk, (c + 1) * chunk) for i in range(ways) for c in (i, 2 * ways - 1 - i)]
    return np.concatenate(pieces).astype(np.int32)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, slots: jax.Array, *,
                   mesh: Any, scale: float, cap: float | None = None, window: int | None = None,
                   row_axes: Any = None, balanced: bool = False) -> jax.Array:
    """Causal self-attention over a token axis split over `mesh`'s `context` axis (a ppermute ring).

    Args:
      q: [B, T, nH, D] rotated queries, token axis in the ring's order (e.g. `balanced_order`).
      k: [B, T, nKV, D] rotated keys, same order.
      v: [B, T, nKV, D].
      segment_ids: [B, T] int, 0 = padding, 1..k the sample a token belongs to (same order).
      slots: [T] int, each token's slot in the original sequence (causality and windows use these).
      mesh: a jax.sharding.Mesh with a `context` axis whose size divides T.
      scale: factor on q . k.
      cap: logit soft-capping, or None.
      window: sliding window W (keys with `q_slot - k_slot < W`), or None.
      row_axes: mesh axes the rows (B) are split over, or None (the rows are then replicated
        over those axes; used when B does not divide them).
      balanced: the token order is `balanced_order(T, n)` (slots of device i: chunks i and 2n-1-i):
        each step after the first then computes only the half of its block that the causal mask
        leaves visible (keys from an earlier device: their first chunk; from a later one: the
        second half of the queries), half the work. False: every block whole, any order.

    Returns:
      [B, T, nH * D] in q's dtype, in the same token order.
    """
    b, t, n_heads, d = q.shape
    n_kv = k.shape[2]
    ways = context_ways(mesh)
    if t % ways:
        raise ValueError(f"ring_attention: {t} tokens do not split over mesh.context={ways}; pad them to a "
                         f"multiple of {2 * ways}")
    tp = mesh.shape.get("tp", 1)
    heads = "tp" if tp > 1 and n_heads % tp == 0 and n_kv % tp == 0 else None
    tokens = P(row_axes, CONTEXT_AXIS, heads, None)
    body = functools.partial(_ring, ways=ways, scale=scale, cap=cap, window=window, balanced=balanced)
    out = jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, P(row_axes, CONTEXT_AXIS), P(CONTEXT_AXIS)),
                        out_specs=tokens, check_vma=False)(q, k, v, segment_ids.astype(jnp.int32),
                                                            slots.astype(jnp.int32))
    return out.reshape(b, t, n_heads * d).astype(q.dtype)


def _ring(q, k, v, segments, slots, *, ways, scale, cap, window, balanced):
    """One device's part: its queries against every piece of keys as they pass around the ring."""
    b, t, n_heads, d = q.shape
    n_kv = k.shape[2]
    qg = q.reshape(b, t, n_kv, n_heads // n_kv, d)  # query head h uses kv head h // G (HF repeat_kv)
    o = jnp.zeros((b, n_kv, t, n_heads // n_kv, d), jnp.float32)
    m = jnp.full((b, n_kv, t, n_heads // n_kv), MASK_VALUE, jnp.float32)
    l = jnp.zeros_like(m)
    chunk = query_chunk(t)
    if chunk is None:
        raise ValueError(f"ring_attention: a piece of {t} tokens has no query chunk; pad with padded_length")
    update = jax.checkpoint(functools.partial(_block, scale=scale, cap=cap, window=window))

    def step(o, m, l, q_rows, q_segments, q_slots, *keys, chunk=chunk):
        """One ring step: the query chunks one by one against this piece of keys."""
        rows = q_rows.shape[1]

        def split(a, axis):
            return jnp.moveaxis(a.reshape(*a.shape[:axis], rows // chunk, chunk, *a.shape[axis + 1:]), axis, 0)

        def one(parts):
            return update(*parts, *keys)

        out = jax.lax.map(one, (split(o, 2), split(m, 2), split(l, 2), split(q_rows, 1), split(q_segments, 1),
                                split(q_slots, 0)))
        return tuple(jnp.moveaxis(a, 0, 2).reshape(a.shape[1], a.shape[2], rows, *a.shape[4:]) for a in out)

    half = t // 2
    half_chunk = chunk if half % chunk == 0 else chunk // 2  # chunk | t and t even: chunk or chunk / 2 divides t / 2

    def earlier(o, m, l, *keys):  # keys from a device before this one: every query sees their first chunk only
        return step(o, m, l, qg, segments, slots, *(a[:, :half] if a.ndim > 1 else a[:half] for a in keys))

    def later(o, m, l, *keys):  # keys from a device after this one: only the second chunk of queries sees them
        new = step(o[:, :, half:], m[:, :, half:], l[:, :, half:], qg[:, half:], segments[:, half:], slots[half:],
                   *keys, chunk=half_chunk)
        return tuple(jnp.concatenate([a[:, :, :half], b], axis=2) for a, b in zip((o, m, l), new))

    ring = [(j, (j + 1) % ways) for j in range(ways)]
    keys = (k, v, segments, slots)
    me = jax.lax.axis_index(CONTEXT_AXIS)
    for i in range(ways):
        if i == 0 or not balanced:
            o, m, l = step(o, m, l, qg, segments, slots, *keys)
        else:  # the keys came from device (me - i) mod n
            o, m, l = jax.lax.cond(i <= me, earlier, later, o, m, l, *keys)
        if i < ways - 1:
            keys = tuple(jax.lax.ppermute(a, CONTEXT_AXIS, ring) for a in keys)
    out = o / jnp.where(l > 0, l, 1.0)[..., None]  # no visible key (padding queries): zeros
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n_heads, d).astype(q.dtype)


def _block(o, m, l, q, q_segments, q_slots, k, v, k_segments, k_slots, *, scale, cap, window):
    """The online-softmax update of (o, m, l) [B, nKV, t, G, (D)] with one block of keys and values."""
    visible = (q_slots[:, None] >= k_slots[None, :])[None]  # causal on original slots
    visible = visible & (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] > 0)
    if window is not None:
        visible = visible & ((q_slots[:, None] - k_slots[None, :]) < window)[None]
    visible = visible[:, None, :, None, :]  # [B, 1, t, 1, s]
    scores = jnp.einsum("btkgd,bskd->bktgs", q, k).astype(jnp.float32)
    scores = jnp.where(visible, scaled_scores(scores, scale, cap), MASK_VALUE)
    # The result does not depend on the running max (it cancels): no gradient through it.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, scores.max(axis=-1)))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    pv = jnp.einsum("bktgs,bskd->bktgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o * correction[..., None] + pv, m_new, l
