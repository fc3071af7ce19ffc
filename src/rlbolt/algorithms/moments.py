"""Segment mean and spread that are exact for tied values and safe for huge ones.

Why this exists: float32 cannot average most values exactly. Sixteen rewards of 1.1 sum to a
number whose division by 16 lands one ulp away from 1.1, so ``r - mean`` is ~1e-7 instead of 0,
the std is ~1e-7 too, and ``centred / (std + eps)`` turns that rounding noise into an advantage
of ~0.1 (0.4 for 64 samples) where the math says 0. Every estimator that centres or scales a
group (GRPO, GSPO, Dr.GRPO, RLOO, the REINFORCE++ baseline, process supervision, batch
whitening) goes through these functions, so the whole class of fault is fixed in one place:

- The mean is clamped into ``[min, max]`` of its segment. The true mean always lies there, so
  the clamp never makes a mean less accurate; for a segment of equal values ``min == max ==
  value``, so the mean *is* the value and every centred entry is exactly 0 (then the std is
  exactly 0 and any ``0 / (0 + eps)`` advantage is exactly 0).
- A sum that overflows (a single reward near the float32 maximum) falls back to summing
  ``value / count``, and a sum of squares that overflows falls back to scaling every deviation
  by 2^-80 first (``2^80 * sqrt(sum((c * 2^-80)^2) / n)``). In the ordinary range the plain
  two-pass formulas are used, unchanged.

Segments are dense indices ``0..num_segments-1`` (see ``groups.dense_group_index``); ``valid``
leaves entries out of every statistic (padding, masked steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


_DOWN, _UP = 2.0 ** -80, 2.0 ** 80


def _rows(x: jax.Array) -> jax.Array:
    """Reduces every axis after the first (a row's steps are summed before its segment)."""
    return x if x.ndim == 1 else x.reshape(x.shape[0], -1)


def _row_sum(x: jax.Array) -> jax.Array:
    return x if x.ndim == 1 else jnp.sum(x, axis=1)


def _expand(per_row: jax.Array, like: jax.Array) -> jax.Array:
    return per_row.reshape(per_row.shape + (1,) * (like.ndim - 1))


def segment_mean(
    values: jax.Array, index: jax.Array, num_segments: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Each segment's mean, equal to the value itself for a segment of equal values.

    Args:
        values: ``[M]`` or ``[M, K]`` float; the K entries of row m all belong to segment
            ``index[m]`` (e.g. the steps of one sample).
        index: ``[M]`` int segment of each row, in ``[0, num_segments)``.
        num_segments: number of segments (static).
        valid: bool like ``values``, entries that count (default: all).

    Returns:
        ``(mean [num_segments], counts [num_segments])``; an empty segment has mean 0.
    """
    values = _rows(jnp.asarray(values))
    valid = jnp.ones(values.shape, bool) if valid is None else _rows(jnp.asarray(valid, bool))
    counts = jax.ops.segment_sum(_row_sum(valid.astype(values.dtype)), index, num_segments)
    safe_counts = jnp.maximum(counts, 1.0)
    mean = jax.ops.segment_sum(_row_sum(jnp.where(valid, values, 0.0)), index, num_segments) / safe_counts
    # Overflow fallback: sum(v / n) never exceeds max |v|.
    shares = jnp.where(valid, values / _expand(safe_counts[index], values), 0.0)
    mean = jnp.where(jnp.isfinite(mean), mean, jax.ops.segment_sum(_row_sum(shares), index, num_segments))
    low = jnp.where(valid, values, jnp.inf)
    high = jnp.where(valid, values, -jnp.inf)
    if values.ndim > 1:
        low, high = low.min(axis=1), high.max(axis=1)
    lowest = jax.ops.segment_min(low, index, num_segments)
    highest = jax.ops.segment_max(high, index, num_segments)
    return jnp.where(counts > 0, jnp.clip(mean, lowest, highest), 0.0), counts


def segment_centre(
    values: jax.Array, index: jax.Array, num_segments: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Each entry minus its segment's mean (``segment_mean``): exactly 0 for equal values.

    Args:
        values: ``[M]`` or ``[M, K]`` float (see ``segment_mean``).
        index: ``[M]`` int segment of each row.
        num_segments: number of segments (static).
        valid: bool like ``values`` (default: all); invalid entries come back 0.

    Returns:
        ``(centred like values, counts [num_segments])``.
    """
    values = jnp.asarray(values)
    mean, counts = segment_mean(values, index, num_segments, valid)
    centred = values - _expand(mean[index], values)
    return (centred if valid is None else jnp.where(jnp.asarray(valid, bool), centred, 0.0)), counts


def segment_rms(
    centred: jax.Array, index: jax.Array, num_segments: int, divisor: jax.Array
) -> jax.Array:
    """``sqrt(sum(centred^2) / divisor)`` per segment, without overflow; 0 where divisor <= 0.

    Args:
        centred: ``[M]`` or ``[M, K]`` float deviations from the segment mean (0 on invalid
            entries).
        index: ``[M]`` int segment of each row.
        num_segments: number of segments (static).
        divisor: ``[num_segments]`` float, e.g. ``counts - ddof``.

    Returns:
        ``[num_segments]`` float: the segment's standard deviation.
    """
    centred = _rows(jnp.asarray(centred))
    ok = divisor > 0
    safe_divisor = jnp.maximum(divisor, 1.0)
    squares = jax.ops.segment_sum(_row_sum(centred * centred), index, num_segments)
    plain = jnp.sqrt(jnp.where(ok, squares / safe_divisor, 0.0))
    # Overflow fallback: scale by 2^-80 first (exact; the reciprocal of the largest deviation
    # itself could be subnormal, which the CPU flushes to 0). Deviations small enough to vanish
    # under the scale are negligible next to the one that overflowed.
    unit = centred * _DOWN
    unit_squares = jax.ops.segment_sum(_row_sum(unit * unit), index, num_segments)
    scaled = _UP * jnp.sqrt(jnp.where(ok, unit_squares / safe_divisor, 0.0))
    return jnp.where(jnp.isfinite(squares), plain, scaled)
