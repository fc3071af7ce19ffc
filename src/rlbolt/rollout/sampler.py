"""NativeSampler: jitted prefill + decode with a static KV cache, prompt-length buckets and
per-sample RNG; implements `RolloutEngine`.

Compilation: one executable per (prompt bucket, micro batch size, sampling options). Prompts
are left-padded to the smallest bucket that fits the call's longest prompt and the batch is
padded to a fixed micro batch size, so calls whose prompts fall in the same bucket reuse it.

Sampling is inverse-CDF sampling from two uniforms per row and step, drawn from
`fold_in(sample_key, step)` (`rlbolt.rollout.sampling`): a block of the vocabulary by its share
of the probability mass, then a token inside it. The draws depend only on the sample's key and
the step, so a sample's tokens never depend on batch composition. (Until this release it was
Gumbel-max, one Gumbel draw per vocabulary entry: the same distribution, other tokens for the
same key, and ~20 ms of a ~120 ms decode step at a 49k vocabulary on CPU.)

The decode executables compile with `rlbolt.utils.xla_flags.decode_compiler_options` (their
32-row dots in YNNPACK, which the CPU flag takes the update's large products out of).

With stop tokens, the rows that stopped are left out of later decode segments (each runs at B,
B/2 or B/4 rows: `rlbolt.rollout.compaction`), so completions that end early cost less.

On a mesh (`sharding=`, a `rlbolt.distributed.ShardingPlan`) the weights stay where the plan
puts them (never gathered onto one device), the rows of a call are split over data x fsdp and
the KV cache keeps its rows there and its key/value heads over `tp` (replicated over `tp` when
the heads do not divide it). Each process passes only its own prompts; the processes agree on
the call's shapes (rows, prompt bucket) first, and each gets its own rows back.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from rlbolt.distributed.agree import max_over_processes
from rlbolt.distributed.sharding import host_value
from rlbolt.models.decoder import Decoder
from rlbolt.models.shared_prefix import prompt_group_size
from rlbolt.rollout.compaction import next_power_of_two
from rlbolt.rollout.engine import RolloutOutput, TurnSession, prompt_rows
from rlbolt.rollout.sampling import SamplingParams
from rlbolt.rollout.decode import DecodeCarry, _generate, _generate_jit, _MeshLayout, decode_segments  # noqa: F401

DEFAULT_PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _mesh_layout(sharding: Any, config: Any) -> _MeshLayout | None:
    """The shardings of one call's rows and KV cache on `sharding`'s mesh (None: no mesh)."""
    if sharding is None:
        return None
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rlbolt.distributed.mesh import BATCH_AXES

    # The rules' kv_heads axis (tp); GQA heads that do not divide it are replicated (and noted).
    heads = sharding.spec_for(("kv_heads",), (config.num_kv_heads,), "the KV cache")[0]
    named = lambda *spec: NamedSharding(sharding.mesh, P(*spec))  # noqa: E731
    return _MeshLayout(rows=named(BATCH_AXES), keys=named(BATCH_AXES, heads), values=named(BATCH_AXES, heads),
                       replicated=named())


class NativeSampler:
    """A jitted JAX sampler for `Decoder` models; implements `rlbolt.rollout.RolloutEngine`.

    Args:
      model: the policy; its parameters are captured now and replaced by `update_weights`.
      max_new_tokens: C, the completion length of every output.
      temperature: softmax temperature; 0 = greedy.
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus mass (1.0 = off).
      stop_token_ids: tokens that end a row (e.g. EOS); none means always generate C tokens.
      pad_id: prompt left-padding and post-stop filler.
      prompt_buckets: allowed padded prompt lengths, ascending.
      micro_batch_size: rows per device call; None pads the whole call to the next power of two.
      noise_upfront_max_bytes: deprecated, no effect (the draw needs two uniforms per row and step,
        not a Gumbel per vocabulary entry; see `rlbolt.rollout.sampling`).
      share_prompts: when a call's rows come as consecutive groups of G rows with one prompt
        (GRPO's `a a b b`, pass@k), prefill each group's prompt once and let its G samples read
        that one prompt cache (same samples; see `rlbolt.models.shared_prefix`). On a mesh with
        more than one batch shard every row keeps its own prompt cache (nothing shared).
      decode_segment: decode steps per segment; the completion cache grows at each segment's
        start to the slots that segment fills, so a step reads only those (None: the whole
        C - 1 slots every step). Each segment is compiled once into the same executable.
      compact_finished: with stop tokens, leave the rows that stopped out of the decode segments
        after the first: each runs the rows still going at the smallest of B, B/2, B/4 rows that
        holds them (`rlbolt.rollout.compaction`; same tokens, more compile time: each size is
        one more copy of the decode loop). Off on a mesh with more than one batch shard.
      sharding: a `rlbolt.distributed.ShardingPlan` to run on (see the module docstring); None
        runs on the default device.
      record_routing: for mixture-of-experts models, keep the experts every token was routed to
        in `last_routing` (router replay: `rlbolt.rollout.token_logps(..., routing=...)`).
    """

    def __init__(self, model: Decoder, *, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, stop_token_ids: Sequence[int] = (), pad_id: int = 0,
                 prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS, micro_batch_size: int | None = None,
                 noise_upfront_max_bytes: int | None = None, share_prompts: bool = True,
                 decode_segment: int | None = 128, compact_finished: bool = True, sharding: Any = None,
                 record_routing: bool = False):
        self.config = model.config
        if noise_upfront_max_bytes is not None:
            warnings.warn("NativeSampler(noise_upfront_max_bytes=...) is deprecated and has no effect: a token is drawn "
                          "from two uniforms per row and step (rlbolt.rollout.sampling); remove the argument",
                          DeprecationWarning, stacklevel=2)
        self.sampling = SamplingParams(max_new_tokens, float(temperature), int(top_k), float(top_p),
                                       tuple(int(t) for t in stop_token_ids), int(pad_id)).validate(model.config.vocab_size)
        buckets = tuple(sorted(int(b) for b in prompt_buckets))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"prompt_buckets={tuple(prompt_buckets)} must be non-empty positive lengths.")
        self.prompt_buckets = buckets
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1 or None.")
        self.micro_batch_size = micro_batch_size
        if decode_segment is not None and decode_segment < 1:
            raise ValueError(f"decode_segment={decode_segment} must be >= 1 or None.")
        self.decode_segment = decode_segment
        # A group's rows would span batch shards: sharing needs a mesh with one batch shard.
        self.share_prompts = bool(share_prompts) and (sharding is None or sharding.batch_shards == 1)
        self.compact_finished = bool(compact_finished) and (sharding is None or sharding.batch_shards == 1)
        self.sharding = sharding
        self._layout = _mesh_layout(sharding, model.config)
        self._graphdef, self._params = nnx.split(model)
        self._shardings = sharding.param_shardings(self._params) if sharding is not None else None
        if sharding is not None:
            self._params = sharding.place(self._params, self._shardings)
        self.policy_version = 0
        self.last_decode_steps = 0  # decode-loop iterations of the last call (max over micro batches)
        self.last_group_size = 1  # rows per prefilled prompt in the last call (1: nothing shared)
        if record_routing and not model.config.num_experts:
            raise ValueError("record_routing=True needs a mixture-of-experts model (config.num_experts > 0).")
        self.record_routing = bool(record_routing)
        # With record_routing: (prompt [N, P, L, k], completion [N, C, L, k]) int32 experts of the last
        # call's tokens per MoE layer. A row's last token (its stop token, or token C - 1) is never
        # fed, so its entry is undefined (it predicts nothing, so its routing changes no logp).
        self.last_routing = None

    def update_weights(self, params: Any, policy_version: int) -> None:
        """Installs new parameters (an `nnx.State` with the model's layout, or a `Decoder`).

        Args:
          params: the new weights; must have the same tree structure and shapes as the model's.
          policy_version: stamped on later RolloutOutputs.
        """
        if isinstance(params, nnx.Module):
            _, params = nnx.split(params)
        want = jax.tree.structure(self._params)
        if jax.tree.structure(params) != want:
            raise ValueError("update_weights: params do not match the sampler's model layout; pass the "
                             "nnx.State from nnx.split(model) of the same architecture.")
        for new, old in zip(jax.tree.leaves(params), jax.tree.leaves(self._params)):
            if new.shape != old.shape:
                raise ValueError(f"update_weights: a parameter has shape {new.shape}, expected {old.shape}.")
        # On a mesh: weights already on this plan's shardings stay put (colocated); others move here.
        self._params = params if self.sharding is None else self.sharding.place(params, self._shardings)
        self.policy_version = int(policy_version)

    @staticmethod
    def compiled_count() -> int:
        """Executables compiled so far by all samplers (one per architecture x bucket x batch x options)."""
        return _generate_jit._cache_size()

    def _sampling(self, opts: dict, where: str) -> SamplingParams:
        """The sampler's SamplingParams with a call's overrides (checked; unknown names refused)."""
        unknown = set(opts) - {"max_new_tokens", "temperature", "top_k", "top_p"}
        if unknown:
            raise TypeError(f"{where}: unknown options {sorted(unknown)}; NativeSampler accepts "
                            "max_new_tokens, temperature, top_k, top_p.")
        return dataclasses.replace(self.sampling, **opts).validate(self.config.vocab_size) if opts else self.sampling

    def open_session(self, prompt_ids: Sequence[Sequence[int]], *, max_total_tokens: int,
                     **opts: Any) -> TurnSession | None:
        """Opens a multi-turn session that keeps each episode's KV cache between turns
        (`rlbolt.rollout.native_session.NativeSession`; the protocol: `rlbolt.rollout.engine`).

        Args:
          prompt_ids: the N opening prompts as id lists.
          max_total_tokens: the most ids after the prompt per episode (bounds the caches).
          **opts: per-session overrides of `max_new_tokens`, `temperature`, `top_k`, `top_p`.

        Returns:
          The session, or None on a mesh of several devices or with `record_routing` (not
            supported there: the caller falls back to `generate` over whole histories).
        """
        from rlbolt.rollout.native_session import NativeSession

        if (self.sharding is not None and self.sharding.mesh.size > 1) or self.record_routing:
            return None
        sp = self._sampling(opts, "open_session")
        return NativeSession(self._graphdef, self._params, self.policy_version, prompt_ids,
                             max_total_tokens=max_total_tokens, sp=sp, prompt_buckets=self.prompt_buckets,
                             share_prompts=self.share_prompts, vocab_size=self.config.vocab_size,
                             max_position_embeddings=self.config.max_position_embeddings)

    def _prepare_prompts(self, prompt_ids, prompt_mask, max_new_tokens, *, processes: bool = False):
        rows = prompt_rows(prompt_ids, prompt_mask, self.config.vocab_size)
        lengths = np.array([len(r) for r in rows])
        longest = int(lengths.max())
        rows_max = len(rows)
        if processes:  # every process must compile the same shapes: the largest call and bucket
            # among the rollout mesh's processes only (another process group runs other programs meanwhile)
            group = sorted({d.process_index for d in self.sharding.mesh.devices.flat})
            rows_max, longest = max_over_processes([len(rows), longest], group)
        fitting = [b for b in self.prompt_buckets if b >= longest]
        if not fitting:
            raise ValueError(f"generate: a prompt has {longest} tokens, more than the largest of prompt_buckets="
                             f"{self.prompt_buckets}; add a bucket >= {longest} or truncate prompts.")
        if longest + max_new_tokens > self.config.max_position_embeddings:
            raise ValueError(f"generate: prompt length {longest} + max_new_tokens={max_new_tokens} exceeds the "
                             f"model's max_position_embeddings={self.config.max_position_embeddings}.")
        bucket = fitting[0]
        ids = np.full((len(rows), bucket), self.sampling.pad_id, np.int32)
        mask = np.zeros((len(rows), bucket), bool)
        for i, r in enumerate(rows):
            ids[i, bucket - len(r):] = r
            mask[i, bucket - len(r):] = True
        return ids, mask, rows_max

    def generate(self, prompt_ids: Sequence[Sequence[int]] | np.ndarray, rng_keys: np.ndarray, *,
                 prompt_mask: np.ndarray | None = None, **opts: Any) -> RolloutOutput:
        """Samples one completion per prompt (see `RolloutEngine.generate`).

        Args:
          prompt_ids: a list of N id lists, or a left-padded [N, P] int array with `prompt_mask`.
          rng_keys: [N, 2] uint32 raw threefry key data, one per sample.
          prompt_mask: [N, P] bool when `prompt_ids` is an array.
          **opts: per-call overrides of `max_new_tokens`, `temperature`, `top_k`, `top_p`
            (each new combination compiles once).

        Returns:
          A RolloutOutput of host numpy arrays; P is the chosen bucket, C is max_new_tokens.
        """
        sp = self._sampling(opts, "generate")
        ids, mask, rows_max = self._prepare_prompts(prompt_ids, prompt_mask, sp.max_new_tokens,
                                                    processes=self.sharding is not None)
        n = ids.shape[0]
        keys = np.asarray(rng_keys)
        if keys.shape != (n, 2) or keys.dtype != np.uint32:
            raise ValueError(f"generate: rng_keys must be [N={n}, 2] uint32 (jax.random.key_data of one threefry "
                             f"key per sample); got {keys.shape} {keys.dtype}.")
        group = prompt_group_size(ids, mask) if self.share_prompts else 1
        if self.micro_batch_size is None:  # whole groups, a power of two of them (bounded compiles)
            micro = group * next_power_of_two(-(-rows_max // group))
        else:
            micro = self.micro_batch_size
            group = group if micro % group == 0 else 1
        if self.sharding is not None:  # a call's rows split evenly over this process's batch shards
            per_process = self.sharding.batch_shards // self.sharding.share.size
            micro = -(-micro // per_process) * per_process
        padded = -(-rows_max // micro) * micro
        if padded > n:  # filler rows: one pad token each; their outputs are dropped
            ids = np.concatenate([ids, np.full((padded - n, ids.shape[1]), sp.pad_id, np.int32)])
            filler_mask = np.zeros((padded - n, mask.shape[1]), bool)
            filler_mask[:, -1] = True
            mask_all = np.concatenate([mask, filler_mask])
            keys_all = np.concatenate([keys, np.zeros((padded - n, 2), np.uint32)])
        else:
            mask_all, keys_all = mask, keys
        # Filler rows are identical, and n and micro are multiples of the group: they fill whole groups.
        segments = decode_segments(sp.max_new_tokens, self.decode_segment)
        put = (lambda x: x) if self.sharding is None else self.sharding.put_local
        results = [_generate_jit(self._params, *put((ids[s:s + micro:group], mask_all[s:s + micro:group],
                                                     keys_all[s:s + micro])),
                                 graphdef=self._graphdef, sp=sp, group=group,
                                 segments=segments, layout=self._layout, compact=self.compact_finished,
                                 record_routing=self.record_routing)
                   for s in range(0, padded, micro)]  # dispatched asynchronously; the host syncs below
        self.last_group_size = group
        rows_of = np.asarray if self.sharding is None else self.sharding.local_rows
        gather = lambda i: np.concatenate([rows_of(r[i]) for r in results])[:n]
        self.last_decode_steps = max(int(host_value(r[3])) for r in results)
        if self.record_routing:
            self.last_routing = (gather(4), gather(5))
        return RolloutOutput(prompt_ids=ids[:n], prompt_mask=mask[:n], completion_ids=gather(0),
                             completion_mask=gather(1), logps=gather(2), policy_version=self.policy_version)
