"""The static-shape key/value cache used by prefill and decode."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax.typing import DTypeLike

from rlbolt.models.config import ModelConfig


class KVCache(NamedTuple):
    """Per-layer keys and values for S slots; slot s holds the token written s-th.

    Keys are stored transposed ([B, nKV, D, S]) so decode attention is a multiply + sum over D
    against a layout XLA never has to transpose (measured on CPU: 0.33 s vs 0.44 s per rollout).

    Attributes:
      keys: tuple over layers of [B, nKV, D, S] (post-RoPE keys).
      values: tuple over layers of [B, nKV, S, D].
      mask: [B, S] bool, True where a slot holds a real token (False for left padding and for
        slots not yet written).
      index: [] int32, the next slot to write; every row writes the same slot (rows are
        left-padded so they stay aligned).
    """

    keys: tuple[jnp.ndarray, ...]
    values: tuple[jnp.ndarray, ...]
    mask: jnp.ndarray
    index: jnp.ndarray

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: DTypeLike | None = None) -> KVCache:
    """An empty cache (zeros, nothing valid, index 0).

    Args:
      config: the model's config.
      batch_size: B.
      max_len: S, the number of slots: prompt length + the tokens that will be fed back.
      dtype: key/value dtype; defaults to the parameter dtype.

    Returns:
      A KVCache pytree.
    """
    dtype = config.dtype if dtype is None else dtype
    kv, d = config.num_kv_heads, config.head_dim
    keys = tuple(jnp.zeros((batch_size, kv, d, max_len), dtype) for _ in range(config.num_layers))
    values = tuple(jnp.zeros((batch_size, kv, max_len, d), dtype) for _ in range(config.num_layers))
    return KVCache(keys, values, jnp.zeros((batch_size, max_len), bool), jnp.zeros((), jnp.int32))
