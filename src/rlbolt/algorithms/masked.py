"""Masked reductions over the completion-token axis (``completion_mask [N, C] bool``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rlbolt.algorithms.moments import segment_centre, segment_rms


def check_token_shapes(name: str, values: jax.Array, mask: jax.Array) -> None:
    """Raises a ValueError naming ``name`` unless ``values`` and ``mask`` are both ``[N, C]``."""
    if jnp.ndim(mask) != 2:
        raise ValueError(f"completion_mask must be [N, C], got shape {jnp.shape(mask)}")
    if jnp.shape(values) != jnp.shape(mask):
        raise ValueError(
            f"{name} must have the completion_mask's shape {jnp.shape(mask)} ([N, C]), got "
            f"{jnp.shape(values)}; pad every column to the same completion length"
        )


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | tuple[int, ...] | None = None) -> jax.Array:
    """Mean of ``values`` over positions where ``mask`` is true; 0 where nothing is valid.

    Args:
        values: ``[N, C]`` float.
        mask: ``[N, C]`` bool.
        axis: axis (or None for all) to reduce.

    Returns:
        The masked mean, with ``axis`` reduced.
    """
    mask = mask.astype(values.dtype)
    total = jnp.sum(jnp.where(mask > 0, values, 0.0), axis=axis)
    count = jnp.sum(mask, axis=axis)
    return total / jnp.maximum(count, 1.0)


@functools.partial(jax.jit, static_argnames=("centre",))
def masked_whiten(values: jax.Array, mask: jax.Array, *, eps: float = 1e-8, centre: bool = True) -> jax.Array:
    """Normalises valid entries to zero mean and unit std over all valid positions.

    Uses the population std (ddof 0). Masked positions come back as 0. Equal valid entries
    come back exactly 0 (the mean is exact for ties, see ``moments.py``), and a single huge
    entry cannot overflow the std.

    Args:
        values: ``[N, C]`` float.
        mask: ``[N, C]`` bool.
        eps: added to the std so a constant input does not divide by zero.
        centre: subtract the mean first; False only divides by the std (about the mean), for
            inputs that are already centred (REINFORCE++ with a group baseline).

    Returns:
        ``[N, C]``: ``(values - mean) / (std + eps)`` on valid positions (``values / (std +
        eps)`` when not ``centre``), 0 elsewhere.
    """
    values = jnp.asarray(values)
    mask = jnp.asarray(mask, bool)
    flat, valid = values.reshape(1, -1), mask.reshape(1, -1)  # one segment holding every token
    index = jnp.zeros((1,), jnp.int32)
    centred, count = segment_centre(flat, index, 1, valid)
    std = segment_rms(centred, index, 1, count)[0]
    scaled = (centred.reshape(values.shape) if centre else values) / (std + eps)
    return jnp.where(mask, scaled, 0.0)


def last_token_one_hot(mask: jax.Array) -> jax.Array:
    """Marks each row's last valid token (where a sequence reward is credited).

    Args:
        mask: ``[N, C]`` bool completion mask.

    Returns:
        ``[N, C]`` bool, true at the last true column of each row; an all-false row stays
        all false.
    """
    mask = jnp.asarray(mask, bool)
    width = mask.shape[1]
    last = width - 1 - jnp.argmax(mask[:, ::-1], axis=1)
    one_hot = jnp.arange(width)[None, :] == last[:, None]
    return one_hot & jnp.any(mask, axis=1, keepdims=True)


def sequence_to_token_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Places a per-sequence reward on its last valid token.

    Args:
        rewards: ``[N]`` float.
        mask: ``[N, C]`` bool completion mask.

    Returns:
        ``[N, C]`` float32: ``rewards[i]`` at row ``i``'s last valid token, 0 elsewhere.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape != (mask.shape[0],):
        raise ValueError(
            f"sequence rewards must be [N]={mask.shape[0]} to match completion_mask "
            f"{mask.shape}, got {rewards.shape}"
        )
    return jnp.where(last_token_one_hot(mask), rewards[:, None], 0.0)
