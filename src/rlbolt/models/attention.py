"""Grouped-query softmax attention: the score scale, Gemma 2's soft-capping and sliding windows.

`attend` is the one attention product of the decoder (training, prefill and decode); the
prompt-shared variant (`rlbolt.models.shared_prefix.attend_with_prefix`) applies the same
`scaled_scores` so both agree to float32 rounding.

Sliding windows (Mistral, Gemma 2 / 3 local layers) are masks on slot distance: a query in
slot q sees key slot k when `q - k < window` (and the causal and padding masks allow it), as
transformers' `sliding_window_overlay`. Rows are left-padded and completions follow their prompt
without gaps, so slot distance is token distance for every real token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": a query row with no visible key (a left-pad row) then gets a
# uniform softmax instead of NaN, and its output is masked downstream anyway.
MASK_VALUE = -1e30


def softcap(x: jnp.ndarray, cap: float | None) -> jnp.ndarray:
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping); x unchanged when cap is None."""
    if cap is None:
        return x
    return cap * jnp.tanh(x / cap)


def scaled_scores(scores: jnp.ndarray, scale: float, cap: float | None) -> jnp.ndarray:
    """Raw q . k products (float32) -> the logits the mask and softmax see: scaled, then soft-capped."""
    return softcap(scores * scale, cap)


def window_visible(query_slots: jnp.ndarray, key_slots: jnp.ndarray, window: int | None) -> jnp.ndarray | None:
    """[Tq, Tk] bool: key slot within `window` of the query slot (`q - k < window`); None without a window.

    Args:
      query_slots: [Tq] int slots of the queries.
      key_slots: [Tk] int slots of the keys (same numbering as the queries).
      window: W, or None for no window.
    """
    if window is None:
        return None
    return (query_slots[:, None] - key_slots[None, :]) < window


def and_window(visible: jnp.ndarray, band: jnp.ndarray | None) -> jnp.ndarray:
    """`visible` [B, Tq, Tk] restricted to a window band [Tq, Tk] (unchanged when band is None)."""
    return visible if band is None else visible & band[None]


def segment_visible(segment_ids: jnp.ndarray) -> jnp.ndarray:
    """[B, T, T] bool: key and query in the same nonzero segment (packed rows; 0 is padding).

    Args:
      segment_ids: [B, T] int, 0 on padding, 1..k the sample each token belongs to in its row.
    """
    keys = segment_ids[:, None, :]
    return (segment_ids[:, :, None] == keys) & (keys > 0)


def attend(q: jnp.ndarray, keys_t: jnp.ndarray, values: jnp.ndarray, visible: jnp.ndarray, *,
           scale: float | None = None, cap: float | None = None) -> jnp.ndarray:
    """Grouped-query softmax attention against (possibly cached) keys.

    Args:
      q: [B, T, nH, D] rotated queries.
      keys_t: [B, nKV, D, S] rotated keys, transposed.
      values: [B, nKV, S, D].
      visible: [B, T, S] bool, which keys each query may see (causal, padding and window).
      scale: factor on q . k; None: D ** -0.5.
      cap: attention logit soft-capping (None: off).

    Returns:
      [B, T, nH * D] in q's dtype.
    """
    b, t, n_heads, d = q.shape
    n_kv = keys_t.shape[1]
    scale = d ** -0.5 if scale is None else scale
    q = q.reshape(b, t, n_kv, n_heads // n_kv, d)  # query head h uses kv head h // G (HF repeat_kv)
    if t == 1:
        # Decode: multiply + sum keeps the cache in its stored layout (faster on CPU than a transposing dot, measured).
        q1 = q[:, 0].astype(jnp.float32)  # [B, nKV, G, D]
        scores = jnp.sum(q1[..., None] * keys_t[:, :, None].astype(jnp.float32), axis=-2)[:, :, None]  # [B,nKV,1,G,S]
    else:
        # In the activation dtype, then f32, like HF (CPU has no bf16 x bf16 -> f32 dot kernel). The
        # scores stay in the dot's own order [B, nKV, T, G, S]: `bkgts` made XLA copy every score-sized
        # array (scores, probabilities and their gradients) into another layout (RESULTS.md, real shapes).
        scores = jnp.einsum("btkgd,bkds->bktgs", q, keys_t).astype(jnp.float32)
    scores = scaled_scores(scores, scale, cap)  # [B, nKV, T, G, S]
    scores = jnp.where(visible[:, None, :, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    if t == 1:
        out = jnp.sum(probs[:, :, 0, :, :, None] * values[:, :, None], axis=-2)[:, None]  # [B,1,nKV,G,D]
    else:
        out = jnp.einsum("bktgs,bksd->btkgd", probs, values)
    return out.reshape(b, t, n_heads * d).astype(q.dtype)
