"""One decoder layer and its parts: grouped-query attention (fused q|k|v, RoPE, q/k norms,
soft-capping, chunked queries) and the gated MLP, pre-norm with optional sandwich norms (Gemma 2/3);
`rlbolt.models.decoder.Decoder` stacks these. Parameter paths and logical axes: the table in
`rlbolt.models.decoder`'s docstring."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.attention import attend
from rlbolt.models.attention_chunks import causal_query_chunks
from rlbolt.models.attention_kernels import KernelCall, fused_attention
from rlbolt.models.config import ModelConfig
from rlbolt.models.layers import Dense, _norm, _normal, _param
from rlbolt.models.mlp_blocks import MlpSplit, block_count, mlp_in_blocks
from rlbolt.models.moe import MoeMLP
from rlbolt.models.rope import apply_rope


class Attention(nnx.Module):
    """Causal grouped-query self-attention with fused q|k|v, optional bias, q/k RMSNorm and soft-capping."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = Dense(c.hidden_size, c.q_size + 2 * c.kv_size, ("embed", "qkv"),
                              use_bias=c.attention_bias, dtype=c.dtype, rngs=rngs)
        self.qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = _norm(c, c.head_dim, "head_dim")
            self.k_norm = _norm(c, c.head_dim, "head_dim")
        self.o_proj = Dense(c.q_size, c.hidden_size, ("heads", "embed"), dtype=c.dtype, rngs=rngs)
        self.scale, self.cap = c.attention_scale, c.attn_logit_softcapping

    def attend(self, q, keys_t, values, visible):
        """`rlbolt.models.attention.attend` with this layer's score scale and soft-capping."""
        return attend(q, keys_t, values, visible, scale=self.scale, cap=self.cap)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The rotated queries, keys and values of x [B, T, H] (cos/sin [B, T, D]).

        Returns:
          (q [B, T, nH, D], k [B, T, nKV, D], v [B, T, nKV, D]); q and k rotated (and
            RMS-normed first when qk_norm).
        """
        b, t, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q = qkv[..., : nh * d].reshape(b, t, nh, d)
        k = qkv[..., nh * d: (nh + nkv) * d].reshape(b, t, nkv, d)
        v = qkv[..., (nh + nkv) * d:].reshape(b, t, nkv, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, visible, cache_kv, query_chunk=None, kernel: KernelCall | None = None):
        """x [B,T,H]; cos/sin [B,T,D]; visible [B,T,S]; cache_kv None or (keys_t, values, index).

        query_chunk: without a cache, the query rows per chunk of causal attention
        (`rlbolt.models.attention_chunks`); None: one piece.
        kernel: a fused kernel for this layer (`rlbolt.models.attention_kernels`); its queries
        attend to the T new keys only (no cache, or a prefill filling a fresh cache); None: XLA.
        """
        q, k, v = self.project(x, cos, sin)
        if kernel is not None:
            out = self.o_proj(fused_attention(kernel, q, k, v, scale=self.scale, cap=self.cap))
            if cache_kv is None:
                return out, None
            keys_t, values, _ = cache_kv  # a prefill: the T new tokens fill the cache's T slots
            return out, (k.transpose(0, 2, 3, 1).astype(keys_t.dtype), v.transpose(0, 2, 1, 3).astype(values.dtype))
        k_t = k.transpose(0, 2, 3, 1)  # [B, nKV, D, T]
        v = v.transpose(0, 2, 1, 3)  # [B, nKV, T, D]
        if cache_kv is None:
            return self.o_proj(causal_query_chunks(self.attend, q, k_t, v, visible, query_chunk)), None
        keys_t, values, index = cache_kv
        zero = jnp.zeros((), jnp.int32)
        k_t = jax.lax.dynamic_update_slice(keys_t, k_t.astype(keys_t.dtype), (zero, zero, zero, index))
        v = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (zero, zero, index, zero))
        return self.o_proj(self.attend(q, k_t, v, visible)), (k_t, v)


class MLP(nnx.Module):
    """Gated feed-forward `down(act(gate(x)) * up(x))` (Shazeer 2020, eq. 6) with fused gate|up:
    SwiGLU (silu), or GeGLU with tanh-approximated gelu (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.intermediate_size = config.intermediate_size
        self.hidden_act = config.hidden_act
        self.gate_up_proj = Dense(config.hidden_size, 2 * config.intermediate_size, ("embed", "mlp"),
                                  dtype=config.dtype, rngs=rngs)
        self.down_proj = Dense(config.intermediate_size, config.hidden_size, ("mlp", "embed"),
                               dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.down_proj(_gated(self.hidden_act)(self.gate_up_proj(x)))

    def split(self, x: jnp.ndarray, split: MlpSplit) -> jnp.ndarray:
        """`self(x)` for x [B, T, H] under `split`: in weight blocks (`rlbolt.models.mlp_blocks`) when
        it names a sharding, the intermediate size splits, and both kernels are plain arrays (a LoRA
        adapter, a bias or a qwix-quantised kernel keeps the whole-kernel path), else over position
        chunks."""
        plain = all(p.lora is None and not p.use_bias and isinstance(_value(p.kernel), jax.Array)
                    for p in (self.gate_up_proj, self.down_proj))
        blocks = block_count(self.intermediate_size, split.block) if plain and split.weights is not None else 1
        if blocks == 1:
            return over_position_chunks(self, x, split.positions)
        return mlp_in_blocks(x, self.gate_up_proj.kernel[...], self.down_proj.kernel[...],
                             activate=_gated(self.hidden_act), blocks=blocks, positions=split.positions,
                             sharding=split.weights)


def _value(kernel):
    return kernel.get_value() if isinstance(kernel, nnx.Variable) else kernel


def _gated(hidden_act: str) -> Callable[[jnp.ndarray], jnp.ndarray]:
    """The gate|up [..., 2I] -> [..., I] activation of `hidden_act` (module-level functions: a
    static key of `rlbolt.models.mlp_blocks`)."""
    return _geglu_tanh if hidden_act == "gelu_pytorch_tanh" else _swiglu


def _geglu_tanh(gate_up: jnp.ndarray) -> jnp.ndarray:
    """`gelu_tanh(gate) * up` (Gemma's gelu_pytorch_tanh) of a fused [..., 2I] gate|up -> [..., I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.gelu(gate, approximate=True) * up


@jax.custom_vjp
def _swiglu(gate_up: jnp.ndarray) -> jnp.ndarray:
    """`silu(gate) * up` of a fused [..., 2I] gate|up projection -> [..., I] (Shazeer 2020, eq. 6).

    The custom backward keeps only `gate_up` as its residual and recomputes the element-wise
    terms, and writes d(gate|up) as one concatenation: autodiff stored silu(gate), sigmoid and
    the product per layer and built the gradient as pad + pad + add (RESULTS.md: update temp
    memory and time).
    """
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate_up):
    return _swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, d_out):
    gate, up = jnp.split(gate_up, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    # d silu(g)/dg = sig(g) * (1 + g * (1 - sig(g)))
    d_gate = d_out * up * sig * (1 + gate * (1 - sig))
    return (jnp.concatenate([d_gate, d_out * gate * sig], axis=-1),)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; with sandwich norms (Gemma)
    each branch's output is RMS-normed again before its residual add."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        h = config.hidden_size
        self.attn_norm = _norm(config, h, "embed")
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = _norm(config, h, "embed")
        self.mlp = MoeMLP(config, rngs=rngs, param=_param, normal=_normal) if moe else MLP(config, rngs=rngs)
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.post_attn_norm = _norm(config, h, "embed")
            self.post_mlp_norm = _norm(config, h, "embed")

    def __call__(self, x, cos, sin, visible, cache_kv, query_chunk=None, routing_out=None, kernel=None,
                 mlp_chunk=None):
        attn_out, new_kv = self.attn(self.attn_norm(x), cos, sin, visible, cache_kv, query_chunk, kernel)
        return self.add_mlp(self.add_attention(x, attn_out), routing_out, mlp_chunk), new_kv

    def add_attention(self, x: jnp.ndarray, attn_out: jnp.ndarray) -> jnp.ndarray:
        """The residual stream after attention: `x + attn_out` (attn_out post-normed with sandwich norms)."""
        return x + (self.post_attn_norm(attn_out) if self.sandwich_norms else attn_out)

    def add_mlp(self, x: jnp.ndarray, routing_out: list | None = None,
                mlp_chunk: int | MlpSplit | None = None) -> jnp.ndarray:
        """The residual stream after the MLP block: `x + mlp(norm(x))` (post-normed with sandwich norms).

        routing_out: a list that an MoE block appends its experts [N, k] to (None: not collected).
        mlp_chunk: how a dense MLP over x [B, T, H] splits (`MLP.split`; the Decoder's `mlp_split()`),
          or a number of positions of every row at a time (`over_position_chunks`); None or 0: whole.
        """
        if routing_out is not None and isinstance(self.mlp, MoeMLP):
            out, experts = self.mlp.routed(self.mlp_norm(x))
            routing_out.append(experts)
        elif isinstance(self.mlp, MoeMLP) or x.ndim != 3:
            out = self.mlp(self.mlp_norm(x))
        else:
            split = mlp_chunk if isinstance(mlp_chunk, MlpSplit) else MlpSplit(mlp_chunk)
            out = self.mlp.split(self.mlp_norm(x), split)
        return x + (self.post_mlp_norm(out) if self.sandwich_norms else out)


def over_position_chunks(fn: Callable[[jnp.ndarray], jnp.ndarray], x: jnp.ndarray, chunk: int | None) -> jnp.ndarray:
    """`fn(x)` for a position-wise `fn` (the dense MLP) over x [B, T, H], `chunk` positions of every
    row at a time, each chunk under `jax.checkpoint`.

    The MLP's [B, T, 2I] intermediates are the largest per-layer buffers of a long sequence (at
    Qwen2.5-7B and 16k tokens, 1.16 GiB per gate|up copy per chip, several live in the update:
    benchmarks/RESULTS.md). In chunks, forward and backward each hold one chunk's; the backward
    recomputes each chunk's intermediates from its input. Under a layer's remat the layer's own
    recompute then skips the MLP (nothing the backward needs comes from its output), so the
    MLP's forward still runs twice, as without chunks. The rows (and their sharding) are untouched;
    positions past T are zero padding, cut off.

    Args:
      fn: maps [B, c, H] to [B, c, H'] position by position.
      x: [B, T, H].
      chunk: positions per chunk; None, 0 or >= T: `fn(x)`.

    Returns:
      [B, T, H'], `fn(x)`'s values (to float32 rounding: another fusion of the same products).
    """
    b, t, h = x.shape
    if not chunk or t <= chunk:
        return fn(x)
    n = -(-t // chunk)
    pieces = jnp.pad(x, ((0, 0), (0, n * chunk - t), (0, 0))).reshape(b, n, chunk, h).swapaxes(0, 1)
    out = jax.lax.map(jax.checkpoint(fn), pieces)  # [n, B, chunk, H']
    return out.swapaxes(0, 1).reshape(b, n * chunk, out.shape[-1])[:, :t]
