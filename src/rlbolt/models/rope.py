"""Rotary position embeddings (Su et al. 2021, RoFormer eq. 34) in Hugging Face's convention.

HF rotates the two contiguous halves of each head ("rotate_half"), not interleaved pairs, so
checkpoints converted from HF need no permutation of the q/k weights.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlbolt.models.config import ModelConfig


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies `1 / theta^(2i/D)`, optionally divided by a linear factor or with Llama 3.1's scaling.

    Computed in float32 with the same operation order as transformers' `_compute_default_rope_parameters`
    and `_compute_llama3_parameters`, so angles agree with HF to float32 rounding at long positions.

    Args:
      head_dim: D (even).
      theta: RoPE base.
      rope_scaling: None or HF's rope_scaling dict (rope_type "default", "linear" or "llama3").

    Returns:
      [D // 2] float32 numpy array.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    rope_type = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":  # positions divided by the factor, i.e. the frequencies (HF's linear scaling)
        return (inv_freq / np.float32(rope_scaling["factor"])).astype(np.float32)
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported; use None, 'default', 'linear' "
                         "or 'llama3'.")
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling["low_freq_factor"])
    high = float(rope_scaling["high_freq_factor"])
    old_context = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((np.float32(old_context) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Cosines and sines of the rotation angles `position * inv_freq`, in float32.

    Args:
      positions: [B, T] int32 token positions.
      inv_freq: [D // 2] float32.

    Returns:
      (cos, sin), each [B, T, D] float32 with the half-angles repeated (HF's `cat(freqs, freqs)`).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates q or k: `x * cos + rotate_half(x) * sin` (HF's `apply_rotary_pos_emb`).

    Args:
      x: [B, T, N, D] queries or keys.
      cos: [B, T, D] from `rope_cos_sin`.
      sin: [B, T, D].

    Returns:
      [B, T, N, D] in x's dtype (cos/sin are cast to it first, as HF does).
    """
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def layer_rope(config: ModelConfig, positions: jnp.ndarray) -> list[tuple[jnp.ndarray, jnp.ndarray]]:
    """(cos, sin) for every layer: sliding layers use `rope_local_theta` when the config sets it (Gemma 3).

    Args:
      config: a `rlbolt.models.config.ModelConfig`.
      positions: [B, T] int32 token positions.

    Returns:
      A list over layers of (cos, sin), each [B, T, D] float32; layers of one kind share the arrays.
    """
    global_rope = rope_cos_sin(positions, rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
    if config.rope_local_theta is None:
        return [global_rope] * config.num_layers
    local_rope = rope_cos_sin(positions, rope_inv_freq(config.head_dim, config.rope_local_theta, None))
    return [local_rope if config.is_sliding(i) else global_rope for i in range(config.num_layers)]
