"""Fused attention kernels (`model.attention`): Pallas splash attention on TPU, cuDNN on GPU.

The XLA path (`rlbolt.models.attention.attend` over query chunks) builds every layer's scores
and softmax, so its memory grows with the square of the sequence length. A fused kernel keeps
no score matrix: memory linear in length. `resolve_attention` maps the config's choice to a kernel:

    auto   TPU: splash   GPU: cudnn   else: xla
    flash  TPU: splash   GPU: cudnn   else: an error (no fused kernel on this platform)
    xla    xla everywhere

Masks are structural, never a [T, T] array: causal, AND the same nonzero segment (`segment_ids`
[B, T] int32, 0 = padding; a left-padded row is segment 1 behind segment-0 pads), AND for sliding
layers `q - k < window`. For real tokens that is exactly the XLA path's mask; a padding query
sees other padding keys instead of nothing, and its output is masked downstream either way.

What each kernel covers, and where a layer falls back to XLA (`fallback_reason`, logged once):

- splash (`jax.experimental.pallas.ops.tpu.splash_attention`): causal, GQA/MQA, sliding windows
  (`LocalMask`), logit soft-capping, segment ids. Every layer runs it. The scale is folded into
  q. Lengths are padded up to a multiple of the block (padding keys are segment 0, after every
  real key). The kernel "splash-interpret" runs the same kernel through Pallas' interpret mode on
  any platform (the CPU tests); "splash" always lowers to Mosaic, also when a CPU host compiles for
  a described TPU slice (`rlbolt plan --topology`).
- cudnn (`jax.nn.dot_product_attention(implementation="cudnn")`): causal, GQA/MQA, sliding
  windows, in bfloat16/float16 with head_dim <= 256 and a multiple of 8. No soft-capping and no
  segment ids: the row's one run of real tokens is rotated to the row's start and given as a
  sequence length, so a row must hold its real tokens contiguously (left padding, a completion
  right-padded after its prompt: every rlbolt row); packed rows (several samples) fall back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rlbolt.config.sections import ATTENTION_CHOICES  # the choices of model.attention
from rlbolt.models.context_attention import ring_attention

# "splash-interpret": the splash kernel through Pallas' interpret mode on any platform (CPU tests); never resolved.
KERNELS = ("xla", "splash", "splash-interpret", "cudnn")
_PLATFORM_KERNEL = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}

_log = logging.getLogger("rlbolt.models")
_LOGGED: set = set()


def resolve_attention(choice: str, platform: str) -> str:
    """The kernel (one of KERNELS) that `model.attention=choice` runs on `platform`.

    Args:
      choice: one of ATTENTION_CHOICES.
      platform: `jax.default_backend()` ("cpu", "gpu", "tpu").

    Raises:
      ValueError: one line naming model.attention and the fix (an unknown choice; flash where
        no fused kernel exists).
    """
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention={choice!r}; use one of {ATTENTION_CHOICES}.")
    if choice == "xla":
        return "xla"
    kernel = _PLATFORM_KERNEL.get(platform)
    if kernel is None and choice == "flash":
        raise ValueError(f"model.attention='flash' has no fused kernel on {platform} (TPU: Pallas splash, "
                         "GPU: cuDNN); use 'auto' or 'xla'.")
    return kernel or "xla"


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """What a fused layer needs beyond q, k and v (built by the decoder for each forward).

    Attributes:
      kernel: "splash", "splash-interpret", "cudnn", or "context" (the ring of mesh.context).
      segment_ids: [B, T] int32, 0 = padding, 1..k the sample a token belongs to.
      window: the layer's sliding window W (keys with `q - k < W`), or None.
      packed: the segment ids came from the caller (several samples per row), not from the mask.
      rows: on a mesh, the NamedSharding of the residual stream (rows over the batch axes): a
        Mosaic kernel cannot be partitioned by XLA, so splash runs under `jax.shard_map` over it.
      slots: kernel "context" (ring attention over mesh.context, `rlbolt.models.context_parallel`):
        [T] int32, the original slot of each token of the ring's order.
    """

    kernel: str
    segment_ids: jax.Array
    window: int | None = None
    packed: bool = False
    rows: Any = None
    slots: Any = None


@dataclasses.dataclass(frozen=True)
class KernelByKind:
    """A scanned layer's kernel when the two kinds of layer run different ones (Gemma's sliding and
    full layers under splash: their masks are static, so two kernels): `local` where the traced
    `sliding` holds, else `full`, through one `jax.lax.cond` (each kernel compiled once in the body).

    Attributes:
      sliding: a scalar bool, this layer's `config.is_sliding(i)` as the scan carries it.
      full: the full-attention layers' KernelCall.
      local: the sliding layers' KernelCall.
    """

    sliding: jax.Array
    full: KernelCall
    local: KernelCall


def fallback_reason(kernel: str, *, dtype: Any, head_dim: int, cap: float | None, packed: bool) -> str | None:
    """Why a layer cannot run `kernel` (it then runs XLA), or None when it can.

    Args:
      kernel: one of KERNELS.
      dtype: the dtype of q, k and v.
      head_dim: D.
      cap: the layer's attention logit soft-capping, or None.
      packed: the rows hold several samples (segment ids from the caller).
    """
    if kernel != "cudnn":
        return None
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN attention takes bfloat16/float16, the layer computes in {jnp.dtype(dtype).name}"
    if head_dim > 256 or head_dim % 8:
        return f"cuDNN attention needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    if cap is not None:
        return "cuDNN attention has no logit soft-capping"
    if packed:
        return "cuDNN attention here takes one run of real tokens per row, not packed segments"
    return None


def log_fallback_once(kernel: str, reason: str, where: str) -> None:
    """Logs (at WARNING, once per process for each message) that `where` runs XLA instead of `kernel`."""
    message = f"model.attention: {where} runs XLA attention instead of {kernel}: {reason}"
    if message not in _LOGGED:
        _LOGGED.add(message)
        _log.warning(message)


def fused_attention(call: KernelCall | KernelByKind, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                    cap: float | None = None, implementation: str = "cudnn") -> jax.Array:
    """Causal self-attention of T queries over the same T keys through `call.kernel`.

    Args:
      call: the kernel, segment ids and window (a KernelByKind: the layer's kind picks one).
      q: [B, T, nH, D] rotated queries.
      k: [B, T, nKV, D] rotated keys.
      v: [B, T, nKV, D].
      scale: factor on q . k.
      cap: logit soft-capping (splash only; see `fallback_reason`).
      implementation: cudnn only: jax.nn.dot_product_attention's backend ("xla" checks the
        rotation and lengths on CPU).

    Returns:
      [B, T, nH * D] in q's dtype.
    """
    if isinstance(call, KernelByKind):
        def run(chosen):
            return lambda q, k, v: fused_attention(chosen, q, k, v, scale=scale, cap=cap, implementation=implementation)
        return jax.lax.cond(call.sliding, run(call.local), run(call.full), q, k, v)
    if call.kernel in ("splash", "splash-interpret"):
        def splash(q, k, v, segment_ids):
            return splash_attention(q, k, v, segment_ids, scale=scale, cap=cap, window=call.window,
                                    interpret=call.kernel == "splash-interpret")
        out = _per_row_shard(splash, call.rows, q, k, v, call.segment_ids)
    elif call.kernel == "context":
        axes = call.rows.spec[0] if len(call.rows.spec) else None
        out = ring_attention(q, k, v, call.segment_ids, call.slots, mesh=call.rows.mesh, scale=scale, cap=cap,
                             window=call.window, row_axes=axes if q.shape[0] % _shards(call.rows) == 0 else None,
                             balanced=True)  # context_parallel.py lays the tokens out in balanced_order
    elif call.kernel == "cudnn":
        out = cudnn_attention(q, k, v, call.segment_ids > 0, scale=scale, window=call.window,
                              implementation=implementation)
    else:
        raise ValueError(f"fused_attention: kernel {call.kernel!r} is not a fused kernel; use one of "
                         f"{KERNELS[1:]}.")
    b, t, n_heads, d = q.shape
    return out.reshape(b, t, n_heads * d).astype(q.dtype)


def _shards(rows) -> int:
    """How many pieces the NamedSharding `rows` cuts dimension 0 into."""
    axes = rows.spec[0] if len(rows.spec) else None
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = 1
    for name in names:
        shards *= rows.mesh.shape[name]
    return shards


def _per_row_shard(fn, rows, *arrays):
    """`fn(*arrays)`, under `jax.shard_map` over the mesh of `rows` (each device its rows; every row on
    every device when the rows do not split evenly) when there is one; arrays are [B, ...]."""
    if rows is None:
        return fn(*arrays)
    axes = rows.spec[0] if len(rows.spec) else None
    row_axes = axes if arrays[0].shape[0] % _shards(rows) == 0 else None
    specs = tuple(P(row_axes, *([None] * (a.ndim - 1))) for a in arrays)
    return jax.shard_map(fn, mesh=rows.mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*arrays)


def _block(t: int) -> int:
    """Splash's query/key block: 512 rows from 1k tokens on (fewer grid steps), else 128."""
    return 512 if t >= 1024 else 128


@functools.lru_cache(maxsize=64)
def _splash_kernel(length: int, n_heads: int, window: int | None, cap: float | None, interpret: bool):
    """The splash kernel for one shape (its mask tables are built in NumPy once per shape and process)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if window is None:
        mask = sa.CausalMask((length, length))
    else:
        mask = sa.LocalMask((length, length), (window - 1, 0), 0)
    block = _block(length)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # concrete mask tables (constants), never a trace's tracers: cached
        return sa.make_splash_mha(sa.MultiHeadMask([mask] * n_heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=cap, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float,
                     cap: float | None = None, window: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas splash attention (causal AND same segment AND window), rows through `jax.vmap`.

    Args:
      q: [B, T, nH, D].
      k: [B, T, nKV, D].
      v: [B, T, nKV, D].
      segment_ids: [B, T] int.
      scale: factor on q . k (folded into q, before the soft-capping as in `scaled_scores`).
      cap: logit soft-capping or None.
      window: sliding window W or None.
      interpret: run through Pallas' interpret mode (any platform) instead of Mosaic (TPU).

    Returns:
      [B, T, nH, D] in q's dtype.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    t = q.shape[1]
    block = _block(t)
    length = -(-t // block) * block
    pad = length - t

    def heads_first(x):  # [B, T, N, D] -> [B, N, L, D], zero rows after T
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    qs = heads_first((q.astype(jnp.float32) * scale).astype(q.dtype))
    segments = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
    kernel = _splash_kernel(length, q.shape[2], window, None if cap is None else float(cap), interpret)
    out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=SegmentIds(s, s)))(
        qs, heads_first(k), heads_first(v), segments)
    return out.transpose(0, 2, 1, 3)[:, :t]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, real: jax.Array, *, scale: float,
                    window: int | None = None, implementation: str = "cudnn") -> jax.Array:
    """`jax.nn.dot_product_attention` over each row's one run of real tokens, rotated to the row's start.

    cuDNN's padding mask counts real tokens from a row's start; rlbolt's rows begin with left
    padding. Each row is rotated left by its leading pads, attended with its real length, and
    rotated back (a gather of q, k, v and the output: linear in T).

    Args:
      q: [B, T, nH, D].
      k: [B, T, nKV, D].
      v: [B, T, nKV, D].
      real: [B, T] bool, True for real tokens (contiguous in each row).
      scale: factor on q . k.
      window: sliding window W (keys with `q - k < W`) or None.
      implementation: "cudnn" (GPU), or "xla" for a CPU check of the rotation.

    Returns:
      [B, T, nH, D]; rows' padding positions hold zeros or an unspecified average.
    """
    t = q.shape[1]
    lead = jnp.argmax(real, axis=1).astype(jnp.int32)  # leading pads (0 for a row without any real token)
    lengths = jnp.maximum(real.sum(axis=1).astype(jnp.int32), 1)
    slots = jnp.arange(t, dtype=jnp.int32)[None]
    forward = (slots + lead[:, None]) % t  # rotated slot j holds original slot (j + lead) % T

    def gather(x, idx):
        return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        gather(q, forward), gather(k, forward), gather(v, forward), scale=scale, is_causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation)
    return gather(out, (slots - lead[:, None]) % t)



def layer_kernel_calls(config: Any, kernel: str, segment_ids: jax.Array, *, packed: bool = False,
                       rows: Any = None) -> list:
    """Per decoder layer: the KernelCall it runs, or None where it falls back to XLA (logged once).

    Args:
      config: the ModelConfig (`rlbolt.models.config`): dtype, head_dim, soft-capping, windows.
      kernel: "splash", "splash-interpret" or "cudnn".
      segment_ids: [B, T] int32 (0 = padding).
      packed: the segment ids came from the caller (several samples per row).
      rows: on a mesh, the residual stream's NamedSharding (`KernelCall.rows`); None off a mesh.

    Returns:
      num_layers entries; layers of one kind share one KernelCall object.
    """
    reason = fallback_reason(kernel, dtype=config.dtype, head_dim=config.head_dim,
                             cap=config.attn_logit_softcapping, packed=packed)
    if reason is not None:
        log_fallback_once(kernel, reason, "every layer")
        return [None] * config.num_layers
    full = KernelCall(kernel, segment_ids, None, packed, rows)
    local = KernelCall(kernel, segment_ids, config.sliding_window, packed, rows)
    return [local if config.is_sliding(i) else full for i in range(config.num_layers)]
