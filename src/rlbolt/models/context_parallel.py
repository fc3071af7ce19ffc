"""Context parallelism in the decoder: a cache-free forward with its token axis split over `mesh.context`.

`Decoder._forward` comes here when its mesh (`Decoder.activation_sharding`) has a `context` axis
of size n > 1 and the forward has no cache (training, log-prob forwards). The rows are padded to
a multiple of 2n tokens (padding tokens: mask 0, segment 0, seen by nobody), their tokens put in
the ring's load-balanced order (`rlbolt.models.context_attention.balanced_order`: device i holds
chunks i and 2n-1-i), the forward runs with every layer's attention as a ring
(`ring_attention`, masks on the ORIGINAL slots, RoPE on the original positions), and the output
(logits or hidden states, and any MoE routing) is put back in the original order and cut to T.
Everything but attention is per-token, so the permutation changes nothing else; the residual
stream's token axis stays split over `context` between the layers (`Decoder.token_sharding`).

With context > 1 every layer runs the ring, whatever `model.attention` chose: its blocks are XLA
products (a fused kernel inside the ring is future work); the choice is logged once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.models.attention_kernels import KernelCall, log_fallback_once
from rlbolt.models.context_attention import balanced_order, context_ways, padded_length


def context_mesh_ways(model: Any) -> int:
    """The `context` axis size of the mesh the decoder's activations live on (1 off a mesh)."""
    sharding = getattr(model, "activation_sharding", None)
    return 1 if sharding is None else context_ways(sharding.mesh)


def context_forward(model: Any, forward: Callable, input_ids: jax.Array, positions: jax.Array, *,
                    attention_mask: jax.Array | None, return_hidden: bool, routing_out: list | None,
                    segment_ids: jax.Array | None) -> tuple[jax.Array, None]:
    """`forward(model, ...)` (the decoder's cache-free forward) over the ring's order, undone on the output.

    Args:
      model: the Decoder (its `activation_sharding` carries the mesh).
      forward: `Decoder._forward`, called with `context_slots` (the original slot of each token).
      input_ids: [B, T] int32.
      positions: [B, T] int32 RoPE positions.
      attention_mask: [B, T] bool or None (all real).
      return_hidden: return final-normed hidden states instead of logits.
      routing_out: a list for MoE layers' experts [B * T, k], or None.
      segment_ids: [B, T] int32 for packed rows, or None.

    Returns:
      (logits [B, T, V] or hidden [B, T, H], None), in the original token order.
    """
    ways = context_mesh_ways(model)
    b, t = input_ids.shape
    length = padded_length(t, ways)
    order = balanced_order(length, ways)
    inverse = np.argsort(order)
    if attention_mask is None:
        attention_mask = jnp.ones((b, t), bool)

    def arrange(x):  # pad the token axis with zeros (padding: mask False, segment 0), then permute
        return jnp.pad(x, ((0, 0), (0, length - t)))[:, order]

    routes = None if routing_out is None else []
    segments = None if segment_ids is None else arrange(segment_ids)
    out, _ = forward(model, arrange(input_ids), arrange(positions), attention_mask=arrange(attention_mask.astype(bool)),
                     cache=None, return_hidden=return_hidden, routing_out=routes, segment_ids=segments,
                     context_slots=jnp.asarray(order))
    if routing_out is not None:
        routing_out.extend(r.reshape(b, length, -1)[:, inverse][:, :t].reshape(b * t, -1) for r in routes)
    return out[:, inverse][:, :t], None


def context_kernel_calls(config: Any, kernel: str, segment_ids: jax.Array, slots: jax.Array, rows: Any,
                         *, packed: bool) -> list:
    """Per decoder layer: the ring's KernelCall (kind "context"), windows for sliding layers.

    Args:
      config: the ModelConfig (windows per layer).
      kernel: the kernel `model.attention` resolved to; any but "xla" is logged as not run.
      segment_ids: [B, T] int32 in the ring's order (0 = padding).
      slots: [T] int32, the original slot of each token.
      rows: the residual stream's NamedSharding (its mesh has the context axis).
      packed: the segment ids came from the caller (several samples per row).

    Returns:
      num_layers KernelCalls; layers of one kind share one object.
    """
    if kernel != "xla":
        log_fallback_once(kernel, "mesh.context > 1 runs ring attention (XLA products per block)", "every layer")
    full = KernelCall("context", segment_ids, None, packed, rows, slots)
    local = KernelCall("context", segment_ids, config.sliding_window, packed, rows, slots)
    return [local if config.is_sliding(i) else full for i in range(config.num_layers)]
