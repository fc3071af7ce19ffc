"""The decoder's layers as one scanned body (`model.scan_layers`): compile time stops growing with depth.

A Python loop over the layers puts every layer's ops into the program once per layer, so the
compile of a 28-layer update takes 14x that of a 2-layer one. Here the cache-free forward
(training, logps) stacks the layers' states along a leading axis at trace time and runs one
`jax.lax.scan` over them: one layer body is compiled whatever the depth. Each layer's own static
choices travel as scanned arrays: whether it is a sliding-window layer (its mask and, for
Gemma 3, its RoPE table are picked with `jnp.where` inside the layer's remat, `ByKind`; under a fused kernel whose two kinds of
layer need two kernels, static masks, the layer's kernel is picked by `jax.lax.cond`:
`rlbolt.models.attention_kernels.KernelByKind`).

Where the layers are stored stacked (`rlbolt.models.stacked_layers`: what a run with
`model.scan_layers` does when the layers can scan and no LoRA adapts them), the scan runs over
that state as it is: no copy. A model whose layers are stored per layer (`layers.{i}...`: built
outside a run, or a LoRA run) is stacked here at trace time, `jnp.stack` of every layer's state
at each forward: one more copy of the layer weights, live during the forward and its backward.

Mixture-of-experts layers scan too (their experts' grouped matmul inside the body). A run that
uses no routing feature stores them stacked like any other layers (the [L, E, H, 2I] and
[L, E, I, H] expert kernels read as they lie: at Qwen3-30B-A3B that per-forward stack was 864 MiB
of bf16 kernels per chip, live through the forward and backward); one that records or replays
routing (`model.router_aux_loss_coef`, `rollout.record_routing`, `algorithm.router_replay`) keeps
them per layer (`stack_reason`: those set attributes on each layer's block), and they are stacked
per forward. Falls back to the loop when the layers differ in structure (Qwen3-MoE's mlp-only
layers, a LoRA that targets some layers only), when an MoE block records or replays its routing
(module state a scan body does not carry: the aux loss, router replay and the mismatch metric),
and when the forward collects routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.attention_kernels import KernelByKind
from rlbolt.models.moe import MoeMLP
from rlbolt.models.stacked_layers import is_stacked


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ByKind:
    """A scanned layer's array that depends on its kind of layer (Gemma 3's RoPE tables, the masks):
    `local` where the traced `sliding` holds, else `full`; `pick` chooses, inside the layer's remat.

    Chosen outside it, the layer's checkpoint took the chosen array as an input, and a checkpoint
    keeps its inputs for the backward: the scan stacked one per layer, two bf16 [L, B, T, D] tables
    (1.5 GiB per chip at Gemma-3-12B and 32k tokens, benchmarks/RESULTS.md). Passed whole, its
    arrays are the same in every layer, and the scan keeps them once.

    Attributes:
      sliding: a scalar bool, this layer's `config.is_sliding(i)` as the scan carries it.
      full: the full-attention layers' array.
      local: the sliding layers' array.
    """

    sliding: jax.Array
    full: jax.Array
    local: jax.Array


def pick(value: Any) -> Any:
    """`value`'s array for its layer when it is a `ByKind`, else `value` itself."""
    return jnp.where(value.sliding, value.local, value.full) if isinstance(value, ByKind) else value


def scan_reason(model: nnx.Module) -> str | None:
    """Why `model`'s layers cannot run as one scanned body, or None when they can.

    Args:
      model: the Decoder.
    """
    if is_stacked(model):
        return None  # stacked only when the layers could scan (rlbolt.models.stacked_layers)
    layers = list(model.layers)
    blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, MoeMLP)]
    if any(block.record or block.replay is not None for block in blocks):
        return "mixture-of-experts layers record or replay their routing (module state a scan body does not carry)"
    first = nnx.graphdef(layers[0])
    if any(nnx.graphdef(layer) != first for layer in layers[1:]):
        return "the layers differ in structure"
    return None


def stack_reason(model: nnx.Module, *, routing: Sequence[str]) -> str | None:
    """Why a run with `model.scan_layers` keeps `model`'s layers stored per layer (scanning them
    stacked per forward), or None when it stores them stacked (`rlbolt.models.stacked_layers`).

    Mixture-of-experts layers are stored stacked only in a run that uses no routing feature: the
    aux loss and the mismatch metric record each layer's routing, and router replay sets each
    layer's experts, through attributes of that layer's block (`rlbolt.models.moe.record_routing`,
    `replay_routing`), which a stacked block, one for every layer, cannot hold per layer.

    Args:
      model: the Decoder.
      routing: the routing features the run uses, as the config fields that turn them on
        (`rlbolt.modules.moe_routing.routing_fields`: model.router_aux_loss_coef,
        rollout.record_routing, algorithm.router_replay); empty: none.
    """
    if is_stacked(model):
        return None
    reason = scan_reason(model)
    if reason is None and routing and any(isinstance(layer.mlp, MoeMLP) for layer in model.layers):
        return (f"the run records or replays each mixture-of-experts layer's routing ({', '.join(routing)}) through "
                "attributes of that layer's block, which a stacked block cannot hold per layer")
    return reason


def kernel_kinds(config: Any, calls: list) -> tuple[Any, Any] | None:
    """(full, local): the kernel every full-attention layer runs and the one every sliding layer runs
    (each a KernelCall or None for XLA; a model of one kind: the same twice), or None when the layers
    of one kind differ or one kind is fused and the other XLA (the scan then declines: the loop runs).

    Args:
      config: the ModelConfig (`is_sliding`).
      calls: per layer, its KernelCall or None (`rlbolt.models.attention_kernels.layer_kernel_calls`).
    """
    kinds: dict[bool, Any] = {}
    for i, call in enumerate(calls):
        if kinds.setdefault(config.is_sliding(i), call) is not call:
            return None
    full = kinds.get(False, kinds.get(True))
    local = kinds.get(True, full)
    if (full is None) != (local is None):
        return None
    return full, local


def scanned_layers(model: nnx.Module, x: jnp.ndarray, ropes: list[tuple[jnp.ndarray, jnp.ndarray]], visible: jnp.ndarray,
                   local_visible: jnp.ndarray | None, kernels: tuple[Any, Any] = (None, None)) -> jnp.ndarray:
    """The residual stream after every layer, computed as one `jax.lax.scan` over the stacked layers.

    Args:
      model: the Decoder (`scan_reason(model)` must be None).
      x: [B, T, H] embeddings.
      ropes: per layer (cos, sin) [B, T, D] (`rlbolt.models.rope.layer_rope`).
      visible: [B, T, T] bool mask of the full-attention layers.
      local_visible: [B, T, T] bool mask of the sliding-window layers.
      kernels: (full, local) as `kernel_kinds` gives them: the fused attention of the full and
        the sliding layers (`rlbolt.models.attention_kernels.KernelCall`; the masks are then None),
        or (None, None) for XLA.

    Returns:
      [B, T, H], as the loop over the layers (to float32 rounding: another fusion of the same ops).
    """
    cfg = model.config
    if is_stacked(model):  # stored stacked: the scan reads the parameters where they are
        graphdef, stacked = nnx.split(model.layers.block)
    else:  # stored per layer: stacked here, one more copy of the layer weights per forward
        layers = list(model.layers)
        graphdef = nnx.graphdef(layers[0])
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(nnx.state(layer) for layer in layers))
    sliding = jnp.asarray([cfg.is_sliding(i) for i in range(cfg.num_layers)])
    kinds = {cfg.is_sliding(i): ropes[i] for i in range(cfg.num_layers)}  # a rope per kind of layer
    global_rope, local_rope = kinds.get(False, kinds.get(True)), kinds.get(True, kinds.get(False))
    mixed = visible is not local_visible
    full_kernel, local_kernel = kernels

    def body(x, per_layer):
        state, is_sliding = per_layer
        layer = nnx.merge(graphdef, state)
        # Picked inside the layer's remat (`ByKind`): chosen here, each layer's would be stacked for the backward.
        cos, sin = ((ByKind(is_sliding, full, local) for full, local in zip(global_rope, local_rope))
                    if local_rope is not global_rope else global_rope)
        mask = ByKind(is_sliding, visible, local_visible) if mixed else visible
        kernel = full_kernel if local_kernel is full_kernel else KernelByKind(is_sliding, full_kernel, local_kernel)
        y, _ = model._layer_step(layer, x, cos, sin, mask, None, None, kernel)
        return model._constrain(y), None

    x, _ = jax.lax.scan(body, x, (stacked, sliding))
    return x
