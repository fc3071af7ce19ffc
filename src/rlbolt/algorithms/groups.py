"""Per-group statistics over samples tagged with arbitrary integer ``group_ids``.

A group is the G completions of one prompt. The trainer tags every sample with a ``group_id``
that may be any integer (non-contiguous, any order, groups of different sizes, e.g. after DAPO
drops samples). Everything here first remaps the ids to dense indices ``0..N-1`` with
``jnp.unique(size=N)`` so the segment ops have a static segment count and stay jittable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlbolt.algorithms.moments import segment_centre, segment_mean, segment_rms


def dense_group_index(group_ids: jax.Array) -> jax.Array:
    """Maps arbitrary group ids to dense segment indices.

    Args:
        group_ids: ``[N]`` int, any values; equal ids mean the same group.

    Returns:
        ``[N]`` int32 in ``[0, N)``; samples share an index iff they share an id.
    """
    group_ids = jnp.asarray(group_ids)
    if group_ids.ndim != 1:
        raise ValueError(
            f"group_ids must be a 1-D [N] array, got shape {group_ids.shape}; "
            "pass one id per sample"
        )
    n = group_ids.shape[0]
    _, inverse = jnp.unique(group_ids, size=n, return_inverse=True)
    return inverse.reshape(n).astype(jnp.int32)


def _check_rewards(values: jax.Array, group_ids: jax.Array) -> None:
    if values.ndim != 1 or values.shape != jnp.shape(group_ids):
        raise ValueError(
            f"rewards must be [N] matching group_ids [N]; got rewards {values.shape} and "
            f"group_ids {jnp.shape(group_ids)}"
        )


def group_count(group_ids: jax.Array) -> jax.Array:
    """Size of each sample's group.

    Args:
        group_ids: ``[N]`` int.

    Returns:
        ``[N]`` float32: the number of samples sharing the sample's id.
    """
    index = dense_group_index(group_ids)
    n = index.shape[0]
    counts = jax.ops.segment_sum(jnp.ones((n,), jnp.float32), index, num_segments=n)
    return counts[index]


def group_mean(values: jax.Array, group_ids: jax.Array) -> jax.Array:
    """Mean of each sample's group, broadcast back to the samples.

    A group of equal values gets exactly that value (see ``moments.segment_mean``), even when
    float32 cannot represent their average (16 x 1.1).

    Args:
        values: ``[N]`` float.
        group_ids: ``[N]`` int.

    Returns:
        ``[N]``: ``mean_{j: g_j = g_i} values_j`` for every sample ``i``.
    """
    values = jnp.asarray(values)
    _check_rewards(values, group_ids)
    index = dense_group_index(group_ids)
    return segment_mean(values, index, index.shape[0])[0][index]


def group_centred(values: jax.Array, group_ids: jax.Array) -> jax.Array:
    """Each value minus its group's mean: exactly 0 for every member of a tied group.

    Args:
        values: ``[N]`` float.
        group_ids: ``[N]`` int.

    Returns:
        ``[N]``: ``values_i - mean(group of i)``.
    """
    values = jnp.asarray(values)
    _check_rewards(values, group_ids)
    index = dense_group_index(group_ids)
    return segment_centre(values, index, index.shape[0])[0]


def group_std(values: jax.Array, group_ids: jax.Array, *, ddof: int = 0) -> jax.Array:
    """Standard deviation of each sample's group, broadcast back to the samples.

    Two-pass (centre first, then square) for accuracy when rewards share a large offset;
    exactly 0 for a group of equal values; no overflow for a single huge value.

    Args:
        values: ``[N]`` float.
        group_ids: ``[N]`` int.
        ddof: delta degrees of freedom: the divisor is ``group_size - ddof``. A group too
            small for the divisor (size <= ddof) gets std 0, not NaN.

    Returns:
        ``[N]``: the std of the sample's group.
    """
    values = jnp.asarray(values)
    _check_rewards(values, group_ids)
    index = dense_group_index(group_ids)
    n = index.shape[0]
    centred, counts = segment_centre(values, index, n)
    return segment_rms(centred, index, n, counts - ddof)[index]


def group_range(values: jax.Array, group_ids: jax.Array) -> jax.Array:
    """Max minus min of each sample's group, broadcast back to the samples.

    Args:
        values: ``[N]`` float.
        group_ids: ``[N]`` int.

    Returns:
        ``[N]``: ``max_group - min_group`` (exactly 0 for a group of identical rewards).
    """
    values = jnp.asarray(values)
    _check_rewards(values, group_ids)
    index = dense_group_index(group_ids)
    n = index.shape[0]
    highest = jax.ops.segment_max(values, index, num_segments=n)
    lowest = jax.ops.segment_min(values, index, num_segments=n)
    return (highest - lowest)[index]
