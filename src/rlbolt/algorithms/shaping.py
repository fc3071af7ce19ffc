"""Length-based reward shaping."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def overlong_penalty(lengths: jax.Array, max_length: int, cache_length: int) -> jax.Array:
    """DAPO's soft overlong punishment, added to the task reward.

    DAPO (arXiv 2503.14476), Eq. 13, with ``L_max`` = max_length, ``L_cache`` = cache_length:
    0 while ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` (falling
    linearly from 0 to -1) while ``|y| <= L_max``; -1 beyond ``L_max``.

    Args:
        lengths: ``[N]`` int completion lengths (``completion_mask.sum(-1)``).
        max_length: L_max, the length from which the penalty is -1.
        cache_length: L_cache, the width of the linear ramp (0 < cache_length <= max_length).

    Returns:
        ``[N]`` float32 penalties in ``[-1, 0]``.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"overlong_penalty needs 0 < cache_length <= max_length, got cache_length="
            f"{cache_length}, max_length={max_length}; DAPO uses 4096 of 20480"
        )
    lengths = jnp.asarray(lengths, jnp.float32)
    soft_start = float(max_length - cache_length)
    ramp = (soft_start - lengths) / float(cache_length)
    return jnp.where(
        lengths <= soft_start, 0.0, jnp.where(lengths <= max_length, ramp, -1.0)
    )
