"""The decoder-only transformer shared by Llama 3, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and Gemma 3, in Flax NNX.

Parameter layout (a contract with `rlbolt.models.hf_io`; nnx state paths, kernels are [in, out]):

    embed.embedding                        [V, H]              ("vocab", "embed")
    layers.{i}.attn_norm.scale             [H]                 ("embed",)
    layers.{i}.attn.qkv_proj.kernel        [H, (nH+2nKV)*D]    ("embed", "qkv")   fused q|k|v
    layers.{i}.attn.qkv_proj.bias          [(nH+2nKV)*D]       ("qkv",)           attention_bias only
    layers.{i}.attn.q_norm.scale           [D]                 ("head_dim",)      qk_norm only
    layers.{i}.attn.k_norm.scale           [D]                 ("head_dim",)      qk_norm only
    layers.{i}.attn.o_proj.kernel          [nH*D, H]           ("heads", "embed")
    layers.{i}.post_attn_norm.scale        [H]                 ("embed",)         sandwich_norms only
    layers.{i}.mlp_norm.scale              [H]                 ("embed",)
    layers.{i}.mlp.gate_up_proj.kernel     [H, 2I]             ("embed", "mlp")   fused gate|up
    layers.{i}.mlp.down_proj.kernel        [I, H]              ("mlp", "embed")   (MoE layers: rlbolt.models.moe)
    layers.{i}.post_mlp_norm.scale         [H]                 ("embed",)         sandwich_norms only
    final_norm.scale                       [H]                 ("embed",)
    lm_head.kernel                         [H, V]              ("embed", "vocab") absent when tied

`layers` is an `nnx.List`, so layer i appears in `nnx.State` under the integer key i
(`nnx.to_flat_state` path `('layers', 0, 'attn', 'qkv_proj', 'kernel')`). A run with
`model.scan_layers` stores them stacked instead (`rlbolt.models.stacked_layers`: path
`('layers', 'block', 'attn', 'qkv_proj', 'kernel')`, [L, H, Q]); the table above stays the
external layout. Every nnx.Param carries
its logical axes as `out_sharding` metadata (with `eager_sharding=False`, so building a model
needs no mesh); `nnx.get_partition_spec(state)` under `flax.linen.logical_axis_rules` maps them
to mesh axes.

Numerics follow Hugging Face's LlamaModel: RMSNorm in float32 with the weight applied after
casting back, RoPE in float32 with rotate_half, softmax in float32; matmuls run in the
parameter dtype (bf16 matmuls measured slower than f32 on CPU) and logits are upcast to float32.
Attention runs over the whole static cache with a validity mask (no per-length recompiles).

Gemma 2 / 3 differ only through config fields (`rlbolt.models.config.ModelConfig`): norms scale by
`1 + weight` computed in float32 (HF's Gemma2RMSNorm), sandwich norms around attention and MLP,
embeddings times sqrt(H), a GeGLU MLP, the attention scale `query_pre_attn_scalar ** -0.5`,
soft-capped attention scores and logits, and sliding-window layers with their own RoPE base.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.attention import MASK_VALUE as _MASK_VALUE  # noqa: F401  (re-exported)
from rlbolt.models.attention import and_window, attend, segment_visible, softcap, window_visible
from rlbolt.config.sections import MLP_BLOCK_SIZE as DEFAULT_MLP_BLOCK_SIZE
from rlbolt.config.sections import MLP_CHUNK_POSITIONS as DEFAULT_MLP_CHUNK_POSITIONS
from rlbolt.models.attention_chunks import DEFAULT_QUERY_CHUNK
from rlbolt.models.attention_kernels import layer_kernel_calls
from rlbolt.models.cache import KVCache
from rlbolt.models.config import ModelConfig
from rlbolt.models.context_parallel import context_forward, context_kernel_calls, context_mesh_ways
from rlbolt.models.decoder_layer import MLP, Attention, DecoderLayer, _swiglu  # noqa: F401  (also imported from here)
from rlbolt.models.embed_lookup import embed_lookup
# The building blocks, also imported from here (LoRA, quantisation, tests).
from rlbolt.models.layers import Dense, Embed, RMSNorm, _norm, _normal, _param  # noqa: F401
from rlbolt.models.mlp_blocks import MlpSplit
from rlbolt.models.moe import MoeMLP
from rlbolt.models.remat import checkpoint_policy, check_remat
from rlbolt.models.rope import layer_rope
from rlbolt.models.scan_layers import kernel_kinds, pick, scan_reason, scanned_layers

_attend = attend  # the name tests and older callers import


def _row_shards(sharding) -> int:
    """How many pieces a NamedSharding cuts dimension 0 into."""
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(sharding.mesh.shape[a] for a in axes)


class Decoder(nnx.Module):
    """A causal language model: embeddings, `num_layers` blocks, final RMSNorm, output projection.

    Build it from a ModelConfig (`tiny_config(...)`, or `load_hf(folder)` for a Hugging Face
    checkpoint), then split it into the static graph and the parameter pytree the Trainer
    trains; merge them back to call it inside a jitted function:

        model = Decoder(tiny_config(vocab_size=64), rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)      # what RLModule.init_params returns
        ids = jnp.asarray([[5, 6, 7]], jnp.int32)            # [B, T]
        positions = jnp.arange(3, dtype=jnp.int32)[None]     # [B, T]
        logits, _ = nnx.merge(graphdef, params)(ids, positions)   # [B, T, V] float32

    Args:
      config: the model's shape; validated here.
      rngs: parameter initialisation RNG (normal std 0.02 like HF; norms start at 1).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        config.validate()
        self.config = config
        self.embed = Embed(config.vocab_size, config.hidden_size, dtype=config.dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs, moe=config.is_moe(i))
                                for i in range(config.num_layers)])
        self.final_norm = _norm(config, config.hidden_size, "embed")
        if not config.tie_word_embeddings:
            self.lm_head = Dense(config.hidden_size, config.vocab_size, ("embed", "vocab"),
                                 dtype=config.dtype, rngs=rngs)
        # On a mesh: the sharding of the residual stream [B, T, H] (rows over the batch axes) and
        # of the embedding table when it is read (the fsdp shards of H gathered first, as every
        # weight is before use), set by `rlbolt.distributed.ShardingPlan.shard_activations`.
        # Static attributes: part of the graph definition, not parameters.
        self.activation_sharding = None
        self.embedding_read_sharding = None
        self.embedding_sharding = None  # the table's own (its gradient's): `rlbolt.models.embed_lookup`
        # With mesh.context > 1: the residual stream with its token axis over `context` too (else None).
        self.token_sharding = None
        # Forwards without a cache (training, logps) run causal attention in chunks of this many
        # query rows, each reading only the keys up to its last row (`rlbolt.models.attention_chunks`):
        # the masked half of the scores is never built. None: one piece. Static, like the above.
        self.attention_query_chunk = DEFAULT_QUERY_CHUNK
        # The dense MLP of every training and logps forward runs this many positions of every row at
        # a time (`rlbolt.models.decoder_layer.over_position_chunks`; model.mlp_chunk_positions). Static.
        self.mlp_chunk_positions = DEFAULT_MLP_CHUNK_POSITIONS
        # On a mesh whose axes split the MLP kernels' hidden dim: gate|up's stored sharding (set by
        # `ShardingPlan.shard_activations`), and the dense MLP then gathers and differentiates its
        # kernels this many intermediate units at a time (`rlbolt.models.mlp_blocks`;
        # model.mlp_block_size). Static.
        self.mlp_weight_sharding = None
        self.mlp_block_size = DEFAULT_MLP_BLOCK_SIZE
        # Activation rematerialisation of each layer in the backward (`rlbolt.models.remat`): one of
        # REMAT_POLICIES, set from the run's model.remat. Static; "none" runs the layers as they are.
        self.remat = "none"
        # Cache-free forwards run the layers as one scanned body (`rlbolt.models.scan_layers`, set
        # from model.scan_layers); layers that cannot be scanned fall back to the loop. Static.
        self.scan_layers = False
        # The attention kernel of the forwards over new tokens only (training, logps, prefill):
        # one of `rlbolt.models.attention_kernels.KERNELS` (`resolve_attention` of model.attention).
        # Decode steps (one query row over the cache) always run XLA. Static.
        self.attention_kernel = "xla"

    def __call__(self, input_ids: jnp.ndarray, positions: jnp.ndarray, *,
                 attention_mask: jnp.ndarray | None = None, cache: KVCache | None = None,
                 return_hidden: bool = False, routing_out: list | None = None,
                 segment_ids: jnp.ndarray | None = None):
        """Runs the model over T new tokens (training, prefill or one decode step).

        Causal masking is always applied. With a cache, the T tokens are written to slots
        `cache.index .. cache.index + T - 1` and attend to every valid earlier slot; rows must be
        left-padded so all rows share the write index.

        Args:
          input_ids: [B, T] int32.
          positions: [B, T] int32 RoPE positions (for left padding: `cumsum(mask) - 1`).
          attention_mask: [B, T] bool, True for real tokens; None means all real.
          cache: a KVCache from `init_cache`, or None for a cache-free forward.
          return_hidden: return the final-normed hidden states instead of logits.
          routing_out: a list that receives each MoE layer's experts [B * T, k] (rlbolt.models.moe).
          segment_ids: [B, T] int32 for a cache-free forward over packed rows (`rlbolt.packing`):
            0 on padding, 1..k the sample a token belongs to; a token sees the earlier tokens of
            its own nonzero segment only (`positions` restart at 0 per sample). None: the
            visibility comes from `attention_mask` (a left-padded row is one sample).

        Returns:
          (logits [B, T, V] float32 or hidden [B, T, H], the updated KVCache or None).
        """
        return self.run(Decoder._forward, input_ids, positions, attention_mask=attention_mask, cache=cache,
                        return_hidden=return_hidden, routing_out=routing_out, segment_ids=segment_ids)

    def run(self, fn, *args, **kwargs):
        """`fn(self, *args, **kwargs)`: the one entry through which every pass over the layers runs.

        `__call__` and the prompt-shared forward and decode step (`rlbolt.models.shared_prefix`)
        all come through here, so a wrapper of this method sees each of them: qwix's quantised
        base (`rlbolt.models.quantize`) intercepts the projections' matmuls here. A pass that
        called the layers around it would hand qwix's quantised kernels to a plain matmul.
        """
        return fn(self, *args, **kwargs)

    def _forward(self, input_ids, positions, *, attention_mask, cache, return_hidden, routing_out=None,
                 segment_ids=None, context_slots=None):
        b, t = input_ids.shape
        if context_slots is None and cache is None and context_mesh_ways(self) > 1:  # rlbolt.models.context_parallel
            return context_forward(self, Decoder._forward, input_ids, positions, attention_mask=attention_mask,
                                   return_hidden=return_hidden, routing_out=routing_out, segment_ids=segment_ids)
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        cfg = self.config
        ropes = layer_rope(cfg, positions)
        if segment_ids is not None and cache is not None:
            raise ValueError("Decoder(segment_ids=...) is for cache-free forwards over packed rows; pass cache=None")
        calls = [None] * cfg.num_layers
        if context_slots is not None:  # the ring over mesh.context: tokens in its order, masks on these slots
            segments = attention_mask.astype(jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
            calls = context_kernel_calls(cfg, self.attention_kernel, segments, context_slots, self.activation_sharding,
                                         packed=segment_ids is not None)
        elif self.attention_kernel != "xla" and t > 1 and (cache is None or cache.max_len == t):
            # A fused kernel attends the T new tokens to each other: no cache, or a prefill filling a fresh one.
            packed = segment_ids is not None  # several samples per row (rlbolt.packing)
            segments = segment_ids.astype(jnp.int32) if packed else attention_mask.astype(jnp.int32)
            calls = layer_kernel_calls(cfg, self.attention_kernel, segments, packed=packed,
                                       rows=self.activation_sharding)
        if all(c is not None for c in calls):
            visible = local_visible = None  # no [B, T, S] mask is built
            cache_mask, index = (None, None) if cache is None else (attention_mask, cache.index)
        elif cache is None:
            causal = jnp.tril(jnp.ones((t, t), bool))
            if segment_ids is None:
                visible = causal[None] & attention_mask[:, None, :]
            else:  # packed rows: causal within the same nonzero segment (slot distance = position distance)
                visible = causal[None] & segment_visible(segment_ids)
            cache_mask, index = None, None
            query_slots = key_slots = jnp.arange(t)
        else:
            index = cache.index
            cache_mask = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (jnp.zeros((), jnp.int32), index))
            slot = jnp.arange(cache.max_len)
            causal = slot[None, :] <= index + jnp.arange(t)[:, None]  # [T, S]
            visible = causal[None] & cache_mask[:, None, :]
            query_slots, key_slots = index + jnp.arange(t), slot
        if visible is not None:  # sliding layers also drop the keys W or more slots behind the query
            local_visible = and_window(visible, window_visible(query_slots, key_slots, cfg.sliding_window))

        x = self.embed_ids(input_ids)
        new_keys, new_values = [], []
        kinds = kernel_kinds(cfg, calls)  # a scanned body runs one kernel per kind of layer
        if self.scan_layers and cache is None and routing_out is None and kinds and scan_reason(self) is None:
            hidden = self.final_norm(scanned_layers(self, x, ropes, visible, local_visible, kinds))
            return (hidden if return_hidden else self.logits(hidden)), None
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache.keys[i], cache.values[i], index)
            cos, sin = ropes[i]
            x, new_kv = self._layer_step(layer, x, cos, sin, local_visible if cfg.is_sliding(i) else visible,
                                         layer_cache, routing_out, calls[i])
            x = self._constrain(x)
            if new_kv is not None:
                new_keys.append(new_kv[0])
                new_values.append(new_kv[1])
        hidden = self.final_norm(x)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(tuple(new_keys), tuple(new_values), cache_mask, index + t)
        return (hidden if return_hidden else self.logits(hidden)), new_cache

    def _layer_step(self, layer, x, cos, sin, visible, layer_cache, routing_out, kernel=None):
        """One decoder layer, under the model's remat policy (`remat_layer`); kernel: its fused
        attention (`rlbolt.models.attention_kernels.KernelCall`) or None for XLA; cos, sin and visible
        may be `rlbolt.models.scan_layers.ByKind` (a scanned layer's), picked inside the remat."""
        chunk = self.attention_query_chunk
        collect = routing_out is not None and isinstance(layer.mlp, MoeMLP)
        if self.remat == "none":
            return layer(x, pick(cos), pick(sin), pick(visible), layer_cache, chunk, routing_out, kernel,
                         self.mlp_split())

        def body(layer, x, cos, sin, visible, layer_cache):
            # The routing leaves the checkpointed function as an output: a list appended to inside
            # it would receive the checkpoint's inner tracers.
            routes = [] if collect else None
            y, new_kv = layer(x, pick(cos), pick(sin), pick(visible), layer_cache, chunk, routes, kernel,  # kernel: closed over
                              self.mlp_split())
            return y, new_kv, (routes[0] if collect else None)

        y, new_kv, experts = self.remat_layer(body)(layer, x, cos, sin, visible, layer_cache)
        if collect:
            routing_out.append(experts)
        return y, new_kv

    def remat_layer(self, fn: Callable) -> Callable:
        """`fn(layer, *arrays)` under `nnx.remat` with the model's remat policy; fn itself for "none".

        Every pass over the layers that training differentiates runs each layer through this
        (`_forward`, the prompt-shared forward of `rlbolt.models.shared_prefix`). Outside a
        gradient the checkpoint changes nothing.

        Args:
          fn: one layer's pass; the layer (an nnx.Module) is its first argument, so nnx.remat
            sees its state.

        Returns:
          A function of the same arguments and outputs.
        """
        if check_remat(self.remat) == "none":
            return fn
        return nnx.remat(fn, policy=checkpoint_policy(self.remat))

    def embed_ids(self, input_ids: jnp.ndarray) -> jnp.ndarray:
        """The embeddings [B, T, H] of input_ids [B, T] (on a mesh: read from the gathered table,
        rows constrained to the batch axes), times sqrt(H) in the parameter dtype for Gemma."""
        if self.embedding_read_sharding is None:
            x = self.embed(input_ids)
        else:  # the table's gradient formed in its own shards (`rlbolt.models.embed_lookup`)
            x = self._constrain(embed_lookup(self.embed.embedding[...], input_ids, read=self.embedding_read_sharding,
                                             stored=getattr(self, "embedding_sharding", None),
                                             rows=self._row_sharding(input_ids[..., None])))
        if self.config.scale_embeddings:  # HF rounds sqrt(H) to the weight dtype first
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)
        return x

    def mlp_split(self) -> MlpSplit:
        """How the dense MLP of a forward over many positions splits (`MLP.split`)."""
        return MlpSplit(self.mlp_chunk_positions, self.mlp_block_size, getattr(self, "mlp_weight_sharding", None))

    def _constrain(self, x: jnp.ndarray) -> jnp.ndarray:
        # Without it XLA may shard activations over the hidden axis like the fsdp weights and
        # then reshard them through full copies. Rows that do not split evenly (a one-row probe,
        # e.g. qwix tracing the model) are left to XLA.
        sharding = self._row_sharding(x)
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def _row_sharding(self, x: jnp.ndarray):
        """The sharding `_constrain` gives x [B, T, ...], or None where it leaves x to XLA."""
        sharding = self.activation_sharding
        if sharding is None or x.shape[0] % _row_shards(sharding):
            return None
        tokens = getattr(self, "token_sharding", None)
        if tokens is not None and x.ndim == 3 and x.shape[1] % context_mesh_ways(self) == 0:
            sharding = tokens  # mesh.context > 1: the token axis split over it too
        return sharding

    def logits(self, hidden: jnp.ndarray) -> jnp.ndarray:
        """Output projection through lm_head, or the tied embedding table, then final soft-capping.

        Args:
          hidden: [..., H] final-normed hidden states.

        Returns:
          [..., V] float32 logits.
        """
        # HF multiplies in the parameter dtype and upcasts; identical for float32 params.
        logits = jnp.dot(hidden, self.output_weight()).astype(jnp.float32)
        return softcap(logits, self.config.final_logit_softcapping)

    def next_token_logits(self, hidden: jnp.ndarray) -> tuple[jnp.ndarray, int]:
        """A decode step's logits for a few rows, laid out for the faster product.

        With tied embeddings the table [V, H] is the product's left operand, read where it lies:
        [V, B] logits, 1.4x faster than [B, V] at V = 49,152 and 32 rows on CPU, where the right
        operand (the 113 MB table) would be repacked at every step (benchmarks/RESULTS.md). An
        untied lm_head [H, V] keeps [B, V] (as the left operand it would be 5x slower).

        Args:
          hidden: [B, H] final-normed hidden states.

        Returns:
          (logits, vocab_axis): [V, B] and 0 when tied, [B, V] and 1 otherwise; float32, soft-capped
          (`rlbolt.rollout.sampling.sample_tokens` takes both).
        """
        if not self.config.tie_word_embeddings:
            return self.logits(hidden), 1
        logits = jnp.einsum("vh,bh->vb", self.embed.embedding[...], hidden).astype(jnp.float32)  # dtypes as logits()
        return softcap(logits, self.config.final_logit_softcapping), 0

    def output_weight(self) -> jnp.ndarray:
        """The output projection [H, V]: lm_head's kernel, or the embedding table transposed when tied."""
        if self.config.tie_word_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]
