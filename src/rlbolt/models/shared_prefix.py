"""The prompt computed once per group: attention against a shared prefix, and the forward pass
that runs each group's prompt once and every sample's completion against it.

In GRPO-style training every prompt is repeated G times (`a a b b`), so its tokens, and with
them its keys and values in every layer, are the same for the G samples. Here the batch's rows
are read as U = B / G consecutive groups of G rows that share one prompt:

    prompt tokens      [U, P]         run once per group (causal, left-padded)
    completion tokens  [B, C - 1]     each attends to its group's prompt keys/values (the
                                      prefix) and to its own earlier completion keys/values

Every product sees the same numbers as the unshared forward over `prompt | completion`, so the
outputs agree up to float32 rounding (the softmax is merged from two parts, the products are
summed in a different order). The gradient through a prompt position is the sum over the
group's samples: the prefix products add up the G samples' contributions themselves.

The dense layers run on the packed tokens `[U * P + B * (C - 1), H]` (one product per kernel
for prompts and completions together); only attention sees the group structure.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.models.attention import MASK_VALUE, and_window, scaled_scores, window_visible
from rlbolt.models.attention_chunks import causal_query_chunks
from rlbolt.models.attention_kernels import fused_attention, layer_kernel_calls
from rlbolt.models.cache import KVCache
from rlbolt.models.decoder import Decoder
from rlbolt.models.rope import layer_rope


def shared_rows_mismatch(prompt_ids, prompt_mask, group_size: int) -> int | None:
    """The first row whose prompt differs from its group's first row, or None when all agree.

    Groups are the consecutive blocks of `group_size` rows; a batch that does not split into
    such blocks returns its row count.
    """
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask, bool)
    n = ids.shape[0]
    if group_size < 2:
        return None
    if n % group_size:
        return n
    ids = ids.reshape(n // group_size, group_size, -1)
    mask = mask.reshape(n // group_size, group_size, -1)
    # Padding slots may hold anything: only real tokens (and where they are) must agree.
    same = (mask == mask[:, :1]).all(-1) & ((ids == ids[:, :1]) | ~mask).all(-1)  # [U, G]
    if same.all():
        return None
    return int(np.argmin(same.reshape(-1)))


def prompt_group_size(prompt_ids, prompt_mask) -> int:
    """The G for which the rows are consecutive groups of G rows with one prompt each (host arrays).

    The largest such G is the run length of the first row's prompt when every block of that
    many rows agrees; 1 when the rows do not form such groups (then nothing is shared).
    """
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask, bool)
    n = ids.shape[0]
    if n < 2:
        return 1
    same_as_first = (mask == mask[:1]).all(-1) & ((ids == ids[:1]) | ~mask).all(-1)
    run = n if same_as_first.all() else int(np.argmin(same_as_first))
    if run < 2 or n % run or shared_rows_mismatch(ids, mask, run) is not None:
        return 1
    return run


def attend_with_prefix(q: jnp.ndarray, prefix_keys_t: jnp.ndarray, prefix_values: jnp.ndarray,
                       prefix_mask: jnp.ndarray, own_keys_t: jnp.ndarray, own_values: jnp.ndarray,
                       own_visible: jnp.ndarray, prefix_band: jnp.ndarray | None = None, *,
                       scale: float | None = None, cap: float | None = None) -> jnp.ndarray:
    """Grouped-query softmax attention over a prefix shared by groups of rows, then own keys.

    Rows `u * G .. u * G + G - 1` of `q` share prefix row u (G = B / U). A query sees every real
    slot of its group's prefix and the own slots `own_visible` allows; the softmax runs over
    both parts at once (one max, one normaliser), as over their concatenation.

    Args:
      q: [B, T, nH, D] rotated queries.
      prefix_keys_t: [U, nKV, D, P] rotated prefix keys, transposed.
      prefix_values: [U, nKV, P, D].
      prefix_mask: [U, P] bool, True on real prefix slots.
      own_keys_t: [B, nKV, D, S] each row's own keys, transposed.
      own_values: [B, nKV, S, D].
      own_visible: [B, T, S] bool, which own keys each query may see.
      prefix_band: None, or [1, T, P] bool: the prefix slots each query's sliding window reaches.
      scale: factor on q . k; None: D ** -0.5.
      cap: attention logit soft-capping (None: off).

    Returns:
      [B, T, nH * D] in q's dtype.
    """
    b, t, n_heads, d = q.shape
    u, n_kv = prefix_keys_t.shape[0], prefix_keys_t.shape[1]
    g, hpk = b // u, n_heads // n_kv
    if u * g != b:
        raise ValueError(f"attend_with_prefix: {b} query rows do not split into {u} groups of equal size")
    scale = d ** -0.5 if scale is None else scale
    # Scores are [B, nKV, T, H, S]: the own part (the long one) in its dot's own order, so XLA
    # copies no own-score-sized array into another layout; the prefix part (P slots) is moved instead.
    if t == 1:  # decode: multiply + sum reads the caches in their stored layout (as `_attend`)
        q1 = q.reshape(u, g, n_kv, hpk, d).astype(jnp.float32)
        s_pre = jnp.sum(q1[..., None] * prefix_keys_t[:, None, :, None].astype(jnp.float32), axis=-2)  # [U,G,K,H,P]
        s_pre = s_pre.reshape(b, n_kv, 1, hpk, -1)
        q1 = q1.reshape(b, n_kv, hpk, d)
        s_own = jnp.sum(q1[..., None] * own_keys_t[:, :, None].astype(jnp.float32), axis=-2)[:, :, None]
    else:
        qg = q.reshape(u, g, t, n_kv, hpk, d)
        s_pre = jnp.einsum("umtkhd,ukds->umkths", qg, prefix_keys_t).astype(jnp.float32)
        s_pre = s_pre.reshape(b, n_kv, t, hpk, -1)
        s_own = jnp.einsum("btkhd,bkds->bkths", q.reshape(b, t, n_kv, hpk, d), own_keys_t).astype(jnp.float32)
    pre_visible = jnp.repeat(prefix_mask, g, axis=0)[:, None, None, None, :]  # [B, 1, 1, 1, P]
    if prefix_band is not None:
        pre_visible = pre_visible & prefix_band[:, None, :, None]  # [B, 1, T, 1, P]
    s_pre = jnp.where(pre_visible, scaled_scores(s_pre, scale, cap), MASK_VALUE)
    s_own = jnp.where(own_visible[:, None, :, None], scaled_scores(s_own, scale, cap), MASK_VALUE)
    top = jax.lax.stop_gradient(jnp.maximum(s_pre.max(-1, keepdims=True), s_own.max(-1, keepdims=True)))
    e_pre, e_own = jnp.exp(s_pre - top), jnp.exp(s_own - top)
    denom = e_pre.sum(-1, keepdims=True) + e_own.sum(-1, keepdims=True)
    p_pre, p_own = (e_pre / denom).astype(prefix_values.dtype), (e_own / denom).astype(own_values.dtype)
    if t == 1:
        p_pre = p_pre.reshape(u, g, n_kv, hpk, -1)
        out = jnp.sum(p_pre[..., None] * prefix_values[:, None, :, None], axis=-2).reshape(b, n_kv, hpk, d)
        out = out + jnp.sum(p_own[:, :, 0, :, :, None] * own_values[:, :, None], axis=-2)
        out = out[:, None]  # [B, 1, nKV, H, D]
    else:
        out = jnp.einsum("umkths,uksd->umtkhd", p_pre.reshape(u, g, n_kv, t, hpk, -1), prefix_values)
        out = out.reshape(b, t, n_kv, hpk, d) + jnp.einsum("bkths,bksd->btkhd", p_own, own_values)
    return out.reshape(b, t, n_heads * d).astype(q.dtype)


def _with_prefix(attn, q, own_keys_t, own_values, own_visible, prefix_keys_t, prefix_values, prefix_mask,
                 prefix_band=None):
    """`attend_with_prefix` in `causal_query_chunks`' argument order (the prefix as its `extra`,
    the window band as its `row_extra`), with the scale and soft-capping of the layer's `attn`."""
    return attend_with_prefix(q, prefix_keys_t, prefix_values, prefix_mask, own_keys_t, own_values, own_visible,
                              prefix_band, scale=attn.scale, cap=attn.cap)


def grouped_completion_hidden(model: Decoder, prompt_ids: jnp.ndarray, prompt_mask: jnp.ndarray,
                              completion_ids: jnp.ndarray, completion_mask: jnp.ndarray,
                              group_size: int) -> jnp.ndarray:
    """The final-normed hidden states that predict each completion token, prompts run once per group.

    Equal (to float32 rounding) to the unshared forward over `prompt | completion` sliced at
    positions P - 1 .. P + C - 2 (`rlbolt.models.logps.completion_hidden`). The last completion
    token predicts nothing, so it is never run.

    Args:
      model: the Decoder (merged from its graphdef and params; LoRA adapters apply as usual).
      prompt_ids: [B, P] int, left-padded; rows of one group (G consecutive rows) must be equal.
      prompt_mask: [B, P] bool; equal within a group likewise.
      completion_ids: [B, C] int, right-padded.
      completion_mask: [B, C] bool.
      group_size: G, rows per group (a static int dividing B); only every G-th prompt row is read.

    Returns:
      [B, C, H] hidden states in the model's dtype.
    """
    return model.run(_grouped_completion_hidden, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     group_size)


def _grouped_completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size):
    b, p = prompt_ids.shape
    c = completion_ids.shape[1]
    if group_size < 1 or b % group_size:
        raise ValueError(f"group_size={group_size} must divide the batch of {b} rows")
    u, g, t = b // group_size, group_size, c - 1
    cfg = model.config
    p_ids, p_mask = prompt_ids[::g].astype(jnp.int32), prompt_mask[::g].astype(bool)  # [U, P]
    c_ids, c_mask = completion_ids[:, :t].astype(jnp.int32), completion_mask[:, :t].astype(bool)  # [B, T]
    # Positions as `left_pad_positions` of the concatenated mask: the prompt's real tokens count on.
    p_pos = jnp.maximum(jnp.cumsum(p_mask.astype(jnp.int32), axis=1) - 1, 0)
    prompt_len = jnp.repeat(p_mask.sum(axis=1, dtype=jnp.int32), g)  # [B]
    c_pos = jnp.maximum(prompt_len[:, None] + jnp.cumsum(c_mask.astype(jnp.int32), axis=1) - 1, 0)
    n_pre = u * p
    positions = jnp.concatenate([p_pos.reshape(1, -1), c_pos.reshape(1, -1)], axis=1)  # packed [1, U*P + B*T]
    ropes = layer_rope(cfg, positions)
    ids = jnp.concatenate([p_ids.reshape(1, -1), c_ids.reshape(1, -1)], axis=1)
    x = model.embed_ids(ids)  # [1, tokens, H]
    kernels = _kernel_calls(model, p_mask, c_mask, g, t)
    if kernels is not None:
        return _fused_grouped_hidden(model, x, ropes, kernels, u, g, p, t)
    p_visible = jnp.tril(jnp.ones((p, p), bool))[None] & p_mask[:, None, :]  # [U, P, P]
    c_visible = jnp.tril(jnp.ones((t, t), bool))[None] & c_mask[:, None, :]  # [B, T, T]
    # Sliding layers: completion token t sits in slot P + t after its prompt's P slots.
    window = cfg.sliding_window
    p_slots, c_slots = jnp.arange(p), jnp.arange(t)
    local = (and_window(p_visible, window_visible(p_slots, p_slots, window)),
             and_window(c_visible, window_visible(c_slots, c_slots, window)),
             (window_visible(p + c_slots, p_slots, window)[None],) if window is not None else ())
    chunk = model.attention_query_chunk  # causal query chunks (rlbolt.models.attention_chunks)
    pre = lambda a: a[0, :n_pre].reshape(u, p, *a.shape[2:])  # noqa: E731
    own = lambda a: a[0, n_pre:].reshape(b, t, *a.shape[2:])  # noqa: E731

    def layer_pass(layer, x, cos, sin, p_vis, c_vis, band):
        q, k, v = layer.attn.project(layer.attn_norm(x), cos, sin)  # [1, tokens, N, D]
        k_pre_t, v_pre = pre(k).transpose(0, 2, 3, 1), pre(v).transpose(0, 2, 1, 3)  # [U,nKV,D,P], [U,nKV,P,D]
        out_pre = causal_query_chunks(layer.attn.attend, pre(q), k_pre_t, v_pre, p_vis, chunk)  # [U, P, nH*D]
        if t:
            out_own = causal_query_chunks(functools.partial(_with_prefix, layer.attn), own(q),
                                          own(k).transpose(0, 2, 3, 1), own(v).transpose(0, 2, 1, 3), c_vis, chunk,
                                          extra=(k_pre_t, v_pre, p_mask), row_extra=band)  # [B, T, nH*D]
            attn = jnp.concatenate([out_pre.reshape(1, n_pre, -1), out_own.reshape(1, b * t, -1)], axis=1)
        else:
            attn = out_pre.reshape(1, n_pre, -1)
        return model._constrain(layer.add_mlp(layer.add_attention(x, layer.attn.o_proj(attn)), None,
                                              model.mlp_split()))

    for i, layer in enumerate(model.layers):  # each layer under the model's remat policy (Decoder.remat_layer)
        p_vis, c_vis, band = local if cfg.is_sliding(i) else (p_visible, c_visible, ())
        x = model.remat_layer(layer_pass)(layer, x, *ropes[i], p_vis, c_vis, band)
    hidden = model.final_norm(x)[0]  # [tokens, H]
    h = hidden.shape[-1]
    last_prompt = jnp.repeat(hidden[:n_pre].reshape(u, p, h)[:, -1], g, axis=0)[:, None]  # [B, 1, H]
    return jnp.concatenate([last_prompt, hidden[n_pre:].reshape(b, t, h)], axis=1)


def _kernel_calls(model, p_mask, c_mask, g, t):
    """Per layer (prompt KernelCall, prompt | completion KernelCall) when model.attention runs a fused
    kernel for every layer (`rlbolt.models.attention_kernels`); None: the XLA path below."""
    if model.attention_kernel == "xla":
        return None
    cfg = model.config
    full_rows = jnp.concatenate([jnp.repeat(p_mask, g, axis=0), c_mask], axis=1).astype(jnp.int32)  # [B, P + T]
    pre = layer_kernel_calls(cfg, model.attention_kernel, p_mask.astype(jnp.int32), rows=model.activation_sharding)
    full = layer_kernel_calls(cfg, model.attention_kernel, full_rows, rows=model.activation_sharding)
    if any(c is None for c in pre):
        return None
    return list(zip(pre, full)) if t else [(c, None) for c in pre]


def _fused_grouped_hidden(model, x, ropes, kernels, u, g, p, t):
    """`_grouped_completion_hidden` through a fused kernel: the prompt attends once per group; each
    sample's completion queries attend over its row `prompt | completion` (the prompt's queries run
    again with it, G times: their outputs are dropped), so no [T, S] mask or score matrix is built.
    The dense layers still run each prompt once."""
    b, n_pre = u * g, u * p
    pre = lambda a: a[0, :n_pre].reshape(u, p, *a.shape[2:])  # noqa: E731
    own = lambda a: a[0, n_pre:].reshape(b, t, *a.shape[2:])  # noqa: E731
    row = lambda a: jnp.concatenate([jnp.repeat(pre(a), g, axis=0), own(a)], axis=1)  # noqa: E731  [B, P + T, ...]

    def layer_pass(layer, x, cos, sin, kernel_pre, kernel_row):
        q, k, v = layer.attn.project(layer.attn_norm(x), cos, sin)  # [1, tokens, N, D]
        attn_of = functools.partial(fused_attention, scale=layer.attn.scale, cap=layer.attn.cap)
        parts = [attn_of(kernel_pre, pre(q), pre(k), pre(v)).reshape(1, n_pre, -1)]
        if t:
            parts.append(attn_of(kernel_row, row(q), row(k), row(v))[:, p:].reshape(1, b * t, -1))
        attn = jnp.concatenate(parts, axis=1)
        return model._constrain(layer.add_mlp(layer.add_attention(x, layer.attn.o_proj(attn)), None,
                                              model.mlp_split()))

    for i, layer in enumerate(model.layers):  # each layer under the model's remat policy (Decoder.remat_layer)
        kernel_pre, kernel_row = kernels[i]
        x = model.remat_layer(lambda layer, x, cos, sin: layer_pass(layer, x, cos, sin, kernel_pre, kernel_row))(
            layer, x, *ropes[i])
    hidden = model.final_norm(x)[0]  # [tokens, H]
    h = hidden.shape[-1]
    last_prompt = jnp.repeat(hidden[:n_pre].reshape(u, p, h)[:, -1], g, axis=0)[:, None]  # [B, 1, H]
    return jnp.concatenate([last_prompt, hidden[n_pre:].reshape(b, t, h)], axis=1)


def decode_with_prefix(model: Decoder, tokens: jnp.ndarray, positions: jnp.ndarray, prefix: KVCache,
                       own: KVCache, read: int, routing_out: list | None = None, *,
                       return_hidden: bool = False) -> tuple[jnp.ndarray, KVCache]:
    """One decode step of B rows against their groups' prompt cache and their own cache.

    The new token's keys/values are written to slot `own.index` of `own`; attention reads the
    group's prompt slots (`prefix`, U = B / G rows, written by a prefill) and the first `read`
    slots of `own` (a static length: the part filled so far, rounded up to a decode segment),
    so a step never reads the unfilled rest of a long cache.

    Args:
      model: the Decoder.
      tokens: [B] int32, the tokens fed this step.
      positions: [B] int32 RoPE positions.
      prefix: the prompts' KVCache, [U, ...] rows (its mask marks real prompt slots).
      own: the rows' completion KVCache, [B, ...] rows; `own.index` is the slot written now.
      read: own slots attention reads (static; > own.index).
      routing_out: a list that receives each MoE layer's experts [B, k] (None: not collected).
      return_hidden: give the final-normed hidden states [B, H] instead of the logits (for
        `Decoder.next_token_logits`, as the decode loop does).

    Returns:
      (logits [B, V] float32 or hidden [B, H], the updated own cache).
    """
    return model.run(_decode_with_prefix, tokens, positions, prefix, own, read, routing_out, return_hidden)


def _decode_with_prefix(model, tokens, positions, prefix, own, read, routing_out=None, return_hidden=False):
    cfg = model.config
    b = tokens.shape[0]
    ropes = layer_rope(cfg, positions[:, None])
    index, zero = own.index, jnp.zeros((), jnp.int32)
    mask = jax.lax.dynamic_update_slice(own.mask, jnp.ones((b, 1), bool), (zero, index))
    visible = mask[:, None, :read]  # [B, 1, read]
    # Sliding layers: the query sits in own slot `index`, i.e. slot P + index after the prompt's P slots.
    window, p = cfg.sliding_window, prefix.max_len
    local_visible = and_window(visible, window_visible(index[None], jnp.arange(read), window))
    prefix_band = None if window is None else window_visible((p + index)[None], jnp.arange(p), window)[None]
    x = model.embed_ids(tokens[:, None])  # [B, 1, H]
    new_keys, new_values = [], []
    for i, layer in enumerate(model.layers):
        sliding = cfg.is_sliding(i)
        q, k, v = layer.attn.project(layer.attn_norm(x), *ropes[i])
        keys = jax.lax.dynamic_update_slice(own.keys[i], k.transpose(0, 2, 3, 1).astype(own.keys[i].dtype),
                                            (zero, zero, zero, index))
        values = jax.lax.dynamic_update_slice(own.values[i], v.transpose(0, 2, 1, 3).astype(own.values[i].dtype),
                                              (zero, zero, index, zero))
        new_keys.append(keys)
        new_values.append(values)
        out = attend_with_prefix(q, prefix.keys[i], prefix.values[i], prefix.mask, keys[..., :read],
                                 values[:, :, :read], local_visible if sliding else visible,
                                 prefix_band if sliding else None, scale=layer.attn.scale, cap=layer.attn.cap)
        x = model._constrain(layer.add_mlp(layer.add_attention(x, layer.attn.o_proj(out)), routing_out))
    hidden = model.final_norm(x)[:, 0]
    cache = KVCache(tuple(new_keys), tuple(new_values), mask, index + 1)
    return (hidden if return_hidden else model.logits(hidden)), cache
