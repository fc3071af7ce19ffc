"""The jitted device side of a multi-turn session (`rlbolt.rollout.native_session`): each
episode keeps its KV cache from turn to turn, and a turn prefills only the ids that are new.

Layout of one session (B rows, one per episode, G consecutive rows per group):

    prefix  [U = B / G, P]   each group's opening prompt but its last id, prefilled once at open
                             (left-padded: its real ids end at slot P - 1)
    own     [B, S]           everything after that, one row per episode, written from slot 0 on:
                             the prompt's last id, then every sampled and environment id that was
                             fed; at most max_total_tokens + 1 slots (the host grows S in a few
                             fixed steps, so a decode step reads only about what is filled)

Own slot j holds the episode's id at RoPE position `start + j` (start = prompt length - 1) and
sits at slot P + j right after the prefix, as in the full-history forward over
`prompt | ids so far`, so causal, padding and sliding-window masks see the same distances.
Rows write at their own `length` (no common write index): an append of D ids scatters them to
slots `length .. length + D - 1` and a slot past the cache is dropped, never clamped onto a
filled one. A turn is a prefill of the new ids (the last turn's final sampled id, never fed by
its decode loop, then the environment's delta), its first token from the last new id, then the
decode loop; a row stops at a stop token, at the turn's max_new_tokens, or when its cache is
full. The host gives a turn a cache with room for every live row's whole turn unless that would
pass max_total_tokens + 1 slots, so a full cache is the budget: the row samples at most one id
past max_total_tokens, and the caller sees that the budget cut the turn.

The uniforms of token k are drawn from `fold_in(turn_key, k)`, as `rlbolt.rollout.decode`
draws them, so a session's turn samples the tokens a `generate` call over the whole history
samples with the same key (up to float32 rounding of the logits).
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.cache import KVCache, init_cache
from rlbolt.models.rope import layer_rope
from rlbolt.models.shared_prefix import attend_with_prefix
from rlbolt.rollout.compaction import take_rows
from rlbolt.rollout.decode import grow_cache
from rlbolt.models.logps import left_pad_positions
from rlbolt.rollout.sampling import SamplingParams, is_stop_token, sample_tokens, step_uniforms
from rlbolt.utils.xla_flags import DecodeJit


class SessionCache(NamedTuple):
    """The KV caches of a session's B episodes (a pytree; rows are episodes).

    Attributes:
      prefix: KVCache of U = B / G rows and P slots: each group's prompt but its last id.
      keys: per layer [B, nKV, D, S] own keys (transposed, as `KVCache`).
      values: per layer [B, nKV, S, D] own values.
      mask: [B, S] bool, True on own slots written.
      length: [B] int32 own slots written (the next slot each row writes).
      start: [B] int32 RoPE position of own slot 0 (the prompt's length - 1).
    """

    prefix: KVCache
    keys: tuple
    values: tuple
    mask: jax.Array
    length: jax.Array
    start: jax.Array


def _open(params, prefix_ids, prefix_mask, *, graphdef, group: int, slots: int) -> SessionCache:
    """Prefills each group's prefix [U, P] once and makes empty own caches of `slots` slots for U * G rows."""
    model = nnx.merge(graphdef, params)
    u, p = prefix_ids.shape
    _, prefix = model(prefix_ids, left_pad_positions(prefix_mask), attention_mask=prefix_mask,
                      cache=init_cache(model.config, u, p), return_hidden=True)
    own = init_cache(model.config, u * group, slots)
    start = jnp.repeat(prefix_mask.sum(axis=1).astype(jnp.int32), group)
    return SessionCache(prefix, own.keys, own.values, own.mask, jnp.zeros((u * group,), jnp.int32), start)


def _append(model, ids, counts, state: SessionCache, group: int):
    """Runs ids [B, D] (the first `counts[b]` of row b real) after each row's cached ids.

    Returns:
      (final-normed hidden [B, D, H], the state with the real ids written and counted).
    """
    cfg = model.config
    b, d = ids.shape
    s, p = state.mask.shape[1], state.prefix.mask.shape[1]
    slots = state.length[:, None] + jnp.arange(d)[None]  # [B, D] own slot of each id
    write = jnp.where(jnp.arange(d)[None] < counts[:, None], slots, s)  # slot s: dropped
    rows = jnp.arange(b)[:, None]
    mask = state.mask.at[rows, write].set(True, mode="drop")
    own_slots = jnp.arange(s)
    visible = mask[:, None, :] & (own_slots[None, None, :] <= slots[:, :, None])  # [B, D, S]
    window = cfg.sliding_window
    if window is not None:  # own slot j sits at slot P + j after the prefix: distances are the same
        local = visible & ((slots[:, :, None] - own_slots[None, None, :]) < window)
        band = ((p + slots)[:, :, None] - jnp.arange(p)[None, None, :]) < window  # [B, D, P]
    ropes = layer_rope(cfg, state.start[:, None] + slots)
    x = model.embed_ids(ids)
    keys, values = [], []
    for i, layer in enumerate(model.layers):
        sliding = cfg.is_sliding(i)
        q, k, v = layer.attn.project(layer.attn_norm(x), *ropes[i])  # k, v [B, D, nKV, Dh]
        k_all = state.keys[i].at[rows, :, :, write].set(k.astype(state.keys[i].dtype), mode="drop")
        v_all = state.values[i].at[rows, :, write, :].set(v.astype(state.values[i].dtype), mode="drop")
        keys.append(k_all)
        values.append(v_all)
        prefix = state.prefix
        out = attend_with_prefix(q, prefix.keys[i], prefix.values[i], prefix.mask, k_all, v_all,
                                 local if sliding else visible, band if sliding else None,
                                 scale=layer.attn.scale, cap=layer.attn.cap)
        x = model._constrain(layer.add_mlp(layer.add_attention(x, layer.attn.o_proj(out))))
    new = state._replace(keys=tuple(keys), values=tuple(values), mask=mask, length=state.length + counts)
    return model.final_norm(x), new


class _TurnCarry(NamedTuple):
    step: jax.Array
    tokens: jax.Array
    state: SessionCache
    done: jax.Array
    ids: jax.Array
    mask: jax.Array
    logps: jax.Array


def _turn(params, state: SessionCache, new_ids, new_counts, live, rng_keys, *, graphdef, sp: SamplingParams,
          group: int):
    """One turn of every live row: prefill its new ids [B, D] (`new_counts` real), then decode.

    Rows not `live` write nothing and sample nothing (their outputs are masked). Returns
    (state, ids [B, C], mask [B, C], logps [B, C], decode steps []).
    """
    model = nnx.merge(graphdef, params)
    batch, steps_total = rng_keys.shape[0], sp.max_new_tokens
    slots = state.mask.shape[1]
    uniforms_at = step_uniforms(rng_keys, sp)
    is_stop = functools.partial(is_stop_token, sp=sp)

    counts = jnp.where(live, new_counts, 0)
    hidden, state = model.run(_append, new_ids, counts, state, group)
    last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, H]
    logits, vocab_axis = model.next_token_logits(last)
    tokens, logps = sample_tokens(logits, uniforms_at(0), sp, vocab_axis=vocab_axis)
    tokens = jnp.where(live, tokens, sp.pad_id)
    out_ids = jnp.full((batch, steps_total), sp.pad_id, jnp.int32).at[:, 0].set(tokens)
    out_mask = jnp.zeros((batch, steps_total), bool).at[:, 0].set(live)
    out_logps = jnp.zeros((batch, steps_total), jnp.float32).at[:, 0].set(jnp.where(live, logps, 0.0))
    # A row is done when it stopped, or when its cache has no slot left for the token it would feed.
    full = lambda st: st.length >= slots  # noqa: E731
    carry = _TurnCarry(jnp.ones((), jnp.int32), tokens, state, ~live | is_stop(tokens) | full(state),
                       out_ids, out_mask, out_logps)

    def body(c: _TurnCarry) -> _TurnCarry:
        alive = ~c.done
        hidden, state = model.run(_append, c.tokens[:, None], alive.astype(jnp.int32), c.state, group)
        logits, vocab_axis = model.next_token_logits(hidden[:, 0])
        new_tokens, new_logps = sample_tokens(logits, uniforms_at(c.step), sp, vocab_axis=vocab_axis)
        new_tokens = jnp.where(alive, new_tokens, sp.pad_id)
        ids = jax.lax.dynamic_update_index_in_dim(c.ids, new_tokens, c.step, axis=1)
        mask = jax.lax.dynamic_update_index_in_dim(c.mask, alive, c.step, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(c.logps, jnp.where(alive, new_logps, 0.0), c.step, axis=1)
        done = c.done | (alive & (is_stop(new_tokens) | full(state)))
        return _TurnCarry(c.step + 1, new_tokens, state, done, ids, mask, logps)

    carry = jax.lax.while_loop(lambda c: (c.step < steps_total) & ~jnp.all(c.done), body, carry)
    return carry.state, carry.ids, carry.mask, carry.logps, carry.step - 1


def _grow(state: SessionCache, *, slots: int) -> SessionCache:
    """The session's own caches with empty slots appended up to `slots` (`decode.grow_cache`)."""
    own = grow_cache(KVCache(state.keys, state.values, state.mask, jnp.zeros((), jnp.int32)), slots)
    return state._replace(keys=own.keys, values=own.values, mask=own.mask)


def _take(state: SessionCache, idx, *, group: int) -> SessionCache:
    """The session's rows `idx` (episodes leaving: the live ones kept), each with its own copy of
    its group's prefix row (the result has one prefix row per row: G = 1)."""
    return take_rows(state._replace(prefix=None), idx)._replace(prefix=take_rows(state.prefix, idx // group))


# One jit per function shared by all sessions (the GraphDef is static), as `rollout.decode` does.
_open_jit = jax.jit(_open, static_argnames=("graphdef", "group", "slots"))
_turn_jit = DecodeJit(_turn, static_argnames=("graphdef", "sp", "group"), donate_argnums=(1,))
_take_jit = jax.jit(_take, static_argnames=("group",))
_grow_jit = jax.jit(_grow, static_argnames=("slots",))


def compiled_count() -> int:
    """Executables compiled so far by the session functions (open, turn, take, grow)."""
    return sum(f._cache_size() for f in (_open_jit, _turn_jit, _take_jit, _grow_jit))
