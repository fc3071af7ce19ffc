"""The decoder's building blocks: parameters with logical axes, RMSNorm, Dense and Embed.

Every nnx.Param carries its logical axes as `out_sharding` metadata (with `eager_sharding=False`,
so building a model needs no mesh); `rlbolt.models.decoder` assembles these into the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.config import ModelConfig

_INIT_STD = 0.02  # HF's initializer_range default


def _param(value: jnp.ndarray, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jnp.ndarray:
    return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """`x * rsqrt(mean(x^2) + eps) * scale` (Zhang & Sennrich 2019, eq. 4), as HF's LlamaRMSNorm.

    With `unit_offset` (Gemma) the factor is `1 + scale` with scale stored centred on 0 (as in
    HF's checkpoints), applied in float32 before the cast back (HF's Gemma2RMSNorm order).
    """

    def __init__(self, size: int, eps: float, axis_name: str, dtype, unit_offset: bool = False):
        self.scale = _param((jnp.zeros if unit_offset else jnp.ones)((size,), dtype), (axis_name,))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...] * normed.astype(x.dtype)


def _norm(config: ModelConfig, size: int, axis_name: str) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, axis_name, config.dtype, config.norm_unit_offset)


class Dense(nnx.Module):
    """`x @ kernel (+ bias)` with logical-axis metadata on its parameters."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str, str], *,
                 use_bias: bool = False, dtype, rngs: nnx.Rngs):
        self.kernel = _param(_normal(rngs, (in_features, out_features), dtype), axes)
        self.use_bias = use_bias
        if use_bias:
            self.bias = _param(jnp.zeros((out_features,), dtype), (axes[1],))
        # rlbolt.models.lora.apply_lora puts a LoraAdapters here when LoRA targets this kernel.
        self.lora = nnx.data(None)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        # A 2-D [tokens, in] dot: with [B, T, in] XLA's CPU backward transposes the activations
        # and output gradients around the weight-gradient dot (update 0.97 -> 0.78 s, RESULTS.md).
        x2d = x.reshape(-1, x.shape[-1])
        y = jnp.dot(x2d, self.kernel[...])
        if self.lora is not None:
            y = y + self.lora(x2d).astype(y.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y + self.bias[...] if self.use_bias else y


class Embed(nnx.Module):
    """Token embedding table; also the output projection when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = _param(_normal(rngs, (vocab_size, hidden_size), dtype), ("vocab", "embed"))

    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        return jnp.take(self.embedding[...], ids, axis=0)
