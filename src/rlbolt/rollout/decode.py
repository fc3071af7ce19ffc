"""The jitted decode of one micro batch (what `NativeSampler` compiles): prefill each group's
prompt once, then the decode loop in segments, finished rows left out of later segments
(`rollout.compaction`), on one device or a mesh (`_MeshLayout`). `NativeSampler` (sampler.py)
prepares the calls: buckets, micro batches, processes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.cache import KVCache, init_cache
from rlbolt.models.shared_prefix import decode_with_prefix
from rlbolt.rollout.compaction import compaction_sizes, run_compacted, take_rows
from rlbolt.models.logps import left_pad_positions
from rlbolt.rollout.sampling import SamplingParams, is_stop_token, sample_tokens, step_uniforms
from rlbolt.utils.xla_flags import DecodeJit

@dataclasses.dataclass(frozen=True)
class _MeshLayout:
    """Shardings inside one sampler call (hashable: part of the compile key)."""

    rows: Any  # [B, ...] arrays: rows over data x fsdp
    keys: Any  # cache keys [B, nKV, D, S]
    values: Any  # cache values [B, nKV, S, D]
    replicated: Any

    def cache(self, cache: KVCache) -> KVCache:
        constrain = jax.lax.with_sharding_constraint
        return KVCache(tuple(constrain(k, self.keys) for k in cache.keys),
                       tuple(constrain(v, self.values) for v in cache.values),
                       constrain(cache.mask, self.rows), cache.index)


def _generate(params, prompt_ids, prompt_mask, rng_keys, *, graphdef, sp: SamplingParams,
              group: int = 1, segments: tuple[int, ...] | None = None, layout: _MeshLayout | None = None,
              compact: bool = False, record_routing: bool = False):
    """Prefill + decode for one micro batch. See NativeSampler. Returns ids, mask, logps [B, C], steps [],
    and with `record_routing` the experts of the prompt [B, P, L, k] and completion [B, C, L, k] tokens.

    prompt_ids / prompt_mask are [U, P]: one row per group of `group` consecutive samples
    (B = U * group rows of rng_keys). Each group's prompt is prefilled once into a prompt cache
    that its samples' decode steps read (`rlbolt.models.shared_prefix.decode_with_prefix`);
    each sample has its own cache of C - 1 slots for the tokens it feeds back. The decode loop
    runs in `segments` (step ends; None: one segment): a step of the segment ending at e reads
    e - 1 own slots.
    On a mesh (`layout`) both caches keep their rows over the batch axes; a group > 1 is only
    passed on meshes with one batch shard.
    """
    model = nnx.merge(graphdef, params)
    on_mesh = (lambda cache: layout.cache(cache)) if layout is not None else (lambda cache: cache)
    batch = rng_keys.shape[0]
    steps_total = sp.max_new_tokens
    uniforms_at = step_uniforms(rng_keys, sp)

    # Prefill, once per group: the prompt's last hidden state gives each sample's first token.
    prompt_cache = on_mesh(init_cache(model.config, prompt_ids.shape[0], prompt_ids.shape[1]))
    prompt_routing = [] if record_routing else None  # per MoE layer [U * P, k] (rlbolt.models.moe)
    hidden, prompt_cache = model(prompt_ids, left_pad_positions(prompt_mask), attention_mask=prompt_mask,
                                 cache=prompt_cache, return_hidden=True, routing_out=prompt_routing)
    prompt_cache = on_mesh(prompt_cache)
    logits, vocab_axis = model.next_token_logits(hidden[:, -1])  # [V, U] with tied embeddings, else [U, V]
    tokens, logps = sample_tokens(jnp.repeat(logits, group, axis=1 - vocab_axis), uniforms_at(0), sp,
                                  vocab_axis=vocab_axis)
    is_stop = functools.partial(is_stop_token, sp=sp)

    out_ids = jnp.full((batch, steps_total), sp.pad_id, jnp.int32).at[:, 0].set(tokens)
    out_mask = jnp.zeros((batch, steps_total), bool).at[:, 0].set(True)
    out_logps = jnp.zeros((batch, steps_total), jnp.float32).at[:, 0].set(logps)
    # The C - 1 tokens fed back (the last sampled token is never fed), in a cache that grows at
    # each segment's start to the slots that segment fills (one slot when C == 1).
    segments = decode_segments(steps_total, None) if segments is None else segments
    own_cache = on_mesh(init_cache(model.config, batch, segments[0] - 1 if segments else 1))
    next_position = jnp.repeat(prompt_mask.sum(axis=1).astype(jnp.int32), group)  # first completion token's
    carry = DecodeCarry(jnp.ones((), jnp.int32), tokens, own_cache, is_stop(tokens), out_ids, out_mask, out_logps)
    if record_routing:  # the experts of completion token c, written by the step that feeds it (c + 1)
        u, p = prompt_ids.shape
        prompt_routing = jnp.repeat(jnp.stack([r.reshape(u, p, -1) for r in prompt_routing], axis=2), group, axis=0)
        carry = carry._replace(routing=(jnp.zeros((batch, steps_total, *prompt_routing.shape[2:]), jnp.int32),))

    def decode_step(carry: DecodeCarry, read, idx, prefix, positions) -> DecodeCarry:
        """One step; idx None: all rows in their groups, else the compacted rows' indices (their
        prompt cache `prefix` and first positions gathered once per segment)."""
        step, tokens, cache, done, out_ids, out_mask, out_logps, routing = carry
        routing_out = [] if record_routing else None
        hidden, cache = decode_with_prefix(model, tokens, positions + step - 1, prefix, cache, read, routing_out,
                                           return_hidden=True)
        if record_routing:  # [B, L, k] for the fed token, completion index step - 1
            routing = (jax.lax.dynamic_update_index_in_dim(routing[0], jnp.stack(routing_out, axis=1), step - 1,
                                                           axis=1),)
        cache = on_mesh(cache)
        logits, vocab_axis = model.next_token_logits(hidden)
        new_tokens, new_logps = sample_tokens(logits, uniforms_at(step, idx), sp, vocab_axis=vocab_axis)
        alive = ~done
        new_tokens = jnp.where(alive, new_tokens, sp.pad_id)
        out_ids = jax.lax.dynamic_update_index_in_dim(out_ids, new_tokens, step, axis=1)
        out_mask = jax.lax.dynamic_update_index_in_dim(out_mask, alive, step, axis=1)
        out_logps = jax.lax.dynamic_update_index_in_dim(out_logps, jnp.where(alive, new_logps, 0.0), step, axis=1)
        done = done | (alive & is_stop(new_tokens))
        return DecodeCarry(step + 1, new_tokens, cache, done, out_ids, out_mask, out_logps, routing)

    def run_segment(begin, end):
        """`run(carry, idx)` for run_compacted: steps begin .. end - 1 on the carry's rows."""
        def run(carry, idx):
            if idx is None:
                prefix, positions = prompt_cache, next_position
            else:  # compacted rows: one gathered prompt row per sample (G = 1), outside the loop
                prefix, positions = take_rows(prompt_cache, idx // group), jnp.take(next_position, idx, axis=0)
            body = functools.partial(decode_step, read=end - 1, idx=idx, prefix=prefix, positions=positions)
            if sp.stop_token_ids:  # early exit once every row has stopped
                return jax.lax.while_loop(lambda c: (c.step < end) & ~jnp.all(c.done), body, carry)
            return jax.lax.fori_loop(begin, end, lambda _, c: body(c), carry)
        return run

    # Rows that stopped are left out of the segments after the first (rlbolt.rollout.compaction):
    # only with stop tokens (otherwise every row runs to the end).
    sizes = compaction_sizes(batch) if sp.stop_token_ids and compact else (batch,)
    begin = 1
    for end in segments:
        # Every step of this segment reads the whole (grown) cache: a static shape, no slicing of
        # the buffer the step writes into (a slice copied it every step: 2x slower on CPU).
        carry = carry._replace(cache=on_mesh(grow_cache(carry.cache, end - 1)))
        carry = run_compacted(carry, carry.done, run_segment(begin, end), sizes if begin > 1 else sizes[:1])
        begin = end
    step, out_ids, out_mask, out_logps, routing = carry.step, carry.ids, carry.mask, carry.logps, carry.routing
    if layout is not None:
        constrain = jax.lax.with_sharding_constraint
        out_ids, out_mask, out_logps = (constrain(x, layout.rows) for x in (out_ids, out_mask, out_logps))
        step = constrain(step, layout.replicated)
    if record_routing:
        return out_ids, out_mask, out_logps, step - 1, prompt_routing, routing[0]
    return out_ids, out_mask, out_logps, step - 1


class DecodeCarry(NamedTuple):
    """The decode loop's state, carried from step to step (a pytree; `rollout.compaction` takes
    and puts back its per-row arrays, leaving the scalar step alone).

    Attributes:
      step: [] int32, the step about to run (completion index it writes).
      tokens: [B] int32, the tokens sampled last (fed at this step).
      cache: each row's own KVCache of the tokens fed so far.
      done: [B] bool, rows that sampled a stop token.
      ids: [B, C] int32 sampled tokens (pad after a stop).
      mask: [B, C] bool, True through the stop token.
      logps: [B, C] float32 sampled tokens' logps (0 where mask is False).
      routing: () or, when recording a mixture-of-experts model's routing, ([B, C, L, k] int32,).
    """

    step: jax.Array
    tokens: jax.Array
    cache: KVCache
    done: jax.Array
    ids: jax.Array
    mask: jax.Array
    logps: jax.Array
    routing: tuple = ()


def grow_cache(cache: KVCache, slots: int) -> KVCache:
    """`cache` with empty slots appended up to `slots` (keys [B, nKV, D, S], values [B, nKV, S, D])."""
    extra = slots - cache.mask.shape[1]
    if extra <= 0:
        return cache
    pad = lambda x, axis: jnp.pad(x, [(0, extra) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
    return KVCache(tuple(pad(k, 3) for k in cache.keys), tuple(pad(v, 2) for v in cache.values),
                   pad(cache.mask, 1), cache.index)


def decode_segments(max_new_tokens: int, segment: int | None) -> tuple[int, ...]:
    """The decode loop's segment ends: steps 1 .. C - 1 in pieces of at most `segment` steps.

    A step reads the own-cache slots up to its segment's end, not all C - 1 slots: with C = 1024
    and segments of 128, the average step reads 64 unfilled slots instead of 512. Each segment
    is one more copy of the decode body in the same executable (compile time, no recompiles).
    A segment of 64 or more starts with a ramp of 1/8, 1/4 and 1/2 of it (16, 32, 64 steps for
    128), so the first steps read 16-64 slots, not 128: at 128 new tokens, where every step sat
    in one segment, the rollout went 6% faster at SmolLM2-135M shapes (benchmarks/RESULTS.md).
    None: one segment.
    """
    steps = max_new_tokens - 1
    if steps <= 0:
        return ()
    if not segment:
        return (max_new_tokens,)
    count = -(-steps // segment)
    size = -(-steps // count)  # equal pieces: no short last segment
    ends = tuple(min(1 + k * size, max_new_tokens) for k in range(1, count + 1))
    ramp = tuple(1 + segment // d for d in (8, 4, 2)) if segment >= 64 else ()
    return tuple(e for e in ramp if e < ends[0]) + ends


# One jit shared by all samplers: the GraphDef (hashable) is a static argument, so samplers of the
# same architecture (policy, eval, tests) share executables. Compiled with the decode's XLA options.
_generate_jit = DecodeJit(_generate, static_argnames=("graphdef", "sp", "group", "segments", "layout",
                                                        "compact", "record_routing"))


