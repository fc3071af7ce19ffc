"""Mixture-of-experts feed-forward (Qwen3-MoE): top-k routing, grouped expert matmuls, the
load-balancing loss, and router replay.

Routing follows transformers' Qwen3MoeTopKRouter: router logits `x @ W_r` in the parameter dtype,
a float32 softmax over the E experts, the top k probabilities (renormalised to sum to 1 when
`norm_topk_prob`), cast back to the parameter dtype. Each token's output is
`sum_j w_j * down_e(act(gate_e(x)) * up_e(x))` over its k experts e = experts[j].

The experts run as two grouped matmuls, not a loop over experts: the N * k (token, expert) pairs
are sorted by expert, each expert's rows are one contiguous group, and a grouped matmul
(`model.moe_matmul`, `rlbolt.models.moe_matmul`: `jax.lax.ragged_dot`, or Pallas megablox gmm on
TPU) multiplies every group by its expert's kernel; the results are weighted and scatter-added
back to their tokens. Work is proportional to N * k, not N * E. gmm, a Mosaic kernel XLA cannot
partition, runs under a shard_map over the whole mesh (`row_mesh`) also without an expert axis.

Expert parallelism (`mesh.expert` > 1, set by `ShardingPlan.shard_activations`): the stacked
expert weights are split over the `expert` mesh axis (E / X experts per device) and the token
rows over the batch axes `data x fsdp x expert`. Inside a `jax.shard_map` manual over the batch
axes (tp stays automatic), each device all-gathers the rows of its expert group (the X devices
that share a data x fsdp position), runs the grouped matmuls for its own E / X experts only (the
other experts' rows go to an empty trailing group), and a reduce-scatter over `expert` sums the
experts' contributions back onto each device's own rows. Cost per MoE layer and forward: one
all-gather and one reduce-scatter of [rows, H] activations over the expert group (the backward
the same again); the expert weights are never gathered over `expert` (their fsdp shards enter the
shard_map as they lie and are all-gathered inside, `MoeMLP.kernel_specs`, so the backward
reduce-scatters their gradients into those shards; entering replicated, every device all-reduced
the whole gradient). The ragged matmuls' row buffers are X times the
local rows times k (static shapes), of which about 1 / X are this device's experts' rows. This is
the all-gather dispatcher (no all-to-all, no capacity factor, no token dropping); a ragged
all-to-all would move only the k routed copies of each token.

Router replay: a forward may be told which experts each token uses (`MoeMLP.replay`, e.g. what
the rollout chose); the weights are then the router's probabilities at those experts (normalised
the same way), so gradients still reach the router. Every forward records its routing as an
`nnx.Intermediate` when `record_routing` switched it on (`routing`: experts [N, k] int32 and router
probabilities [N, E] float32) that `pop_routing` collects, for the load-balancing loss and the
routing-mismatch metric.

Parameter layout (experts stacked on axis 0, kernels [in, out]):

    layers.{i}.mlp.router_kernel      [H, E]        ("embed", None)
    layers.{i}.mlp.gate_up            [E, H, 2I]    ("experts", "embed", "mlp")   fused gate|up
    layers.{i}.mlp.down               [E, I, H]     ("experts", "mlp", "embed")

Stored stacked (`model.scan_layers` in a run without routing features: `scan_layers.stack_reason`),
`layers.block.mlp.*` carry a leading [L] axis ("layers"); one MoeMLP holds every layer's kernels and
static settings (`moe_layers`), and routing cannot be recorded or replayed per layer on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlbolt.distributed.mesh import BATCH_AXES, batch_shards
from rlbolt.models.expert_blocks import experts_in_blocks, gathered, swiglu_experts
from rlbolt.models.mlp_blocks import block_count
from rlbolt.models.stacked_layers import is_stacked


def route(logits: jnp.ndarray, top_k: int, norm_topk_prob: bool,
          forced: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Top-k routing of N tokens over E experts, as transformers' Qwen3MoeTopKRouter.

    Args:
      logits: [N, E] router logits (parameter dtype).
      top_k: k experts per token.
      norm_topk_prob: renormalise the k chosen probabilities to sum to 1.
      forced: None, or [N, k] int experts to use instead of the top k (router replay).

    Returns:
      (weights [N, k] in logits' dtype, experts [N, k] int32, probs [N, E] float32).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if forced is None:
        top, experts = jax.lax.top_k(probs, top_k)
    else:
        experts = forced.astype(jnp.int32)
        top = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(logits.dtype), experts.astype(jnp.int32), probs


def grouped_experts(x: jnp.ndarray, experts: jnp.ndarray, weights: jnp.ndarray, gate_up: jnp.ndarray,
                    down: jnp.ndarray, hidden_act: str = "silu", kernel: str = "ragged_dot", blocks: int = 1,
                    specs: tuple[P, P] | None = None) -> jnp.ndarray:
    """`sum_j weights[:, j] * expert_{experts[:, j]}(x)` with one grouped matmul per projection.

    Args:
      x: [N, H] tokens.
      experts: [N, k] int expert of each (token, slot).
      weights: [N, k] routing weights.
      gate_up: [E, H, 2I] fused gate|up kernels.
      down: [E, I, H].
      hidden_act: "silu" (SwiGLU experts).
      kernel: the grouped matmul (`rlbolt.models.moe_matmul.KERNELS`).
      blocks: > 1: gate_up and down are this device's shards inside a shard_map, gathered over `specs`
        a block of the intermediate dim at a time (`rlbolt.models.expert_blocks`); 1: whole kernels.
      specs: with blocks > 1, the kernels' in_specs at the shard_map's edge.

    Returns:
      [N, H] in x's dtype.
    """
    n, k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token = order // k
    # [E] rows per expert; an expert id E (expert parallelism: another device's expert) counts in
    # no group, sorts last and its rows come out 0 from the grouped matmul.
    sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    if hidden_act != "silu":
        raise ValueError(f"grouped_experts: hidden_act={hidden_act!r}; the MoE experts support 'silu'.")
    rows = jnp.take(x, token, axis=0)
    if blocks > 1:
        y = experts_in_blocks(rows, sizes, gate_up, down, blocks=blocks, specs=specs, kernel=kernel)  # [N*k, H]
    else:
        y = swiglu_experts(rows, sizes, gate_up, down, kernel)  # [N*k, H]
    w = jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros_like(x).at[token].add((y * w).astype(x.dtype))


def expert_parallel_experts(x: jnp.ndarray, experts: jnp.ndarray, weights: jnp.ndarray, gate_up: jnp.ndarray,
                            down: jnp.ndarray, hidden_act: str, mesh: jax.sharding.Mesh,
                            kernel: str = "ragged_dot", specs: tuple[P, P] | None = None,
                            block: int = 0) -> jnp.ndarray:
    """`grouped_experts` with the experts split over `mesh`'s `expert` axis (module docstring).

    With `ragged_dot` the shard_map is manual over the batch axes only (tp stays automatic); a Pallas
    kernel (gmm) cannot be partitioned by XLA, so then every axis is manual: the expert weights are
    gathered over fsdp and tp at the shard_map's edge and each device computes its rows whole.

    Args:
      x: [N, H]; rows over the batch axes (N must divide them), as for `experts` and `weights`.
      experts: [N, k] int chosen experts.
      weights: [N, k] their routing weights.
      gate_up: [E, H, 2I], axis 0 over `expert`.
      down: [E, I, H], axis 0 over `expert`.
      hidden_act: as in `grouped_experts`.
      mesh: the mesh (axes data, fsdp, expert, context, tp).
      kernel: the grouped matmul (`rlbolt.models.moe_matmul.KERNELS`).
      specs: the stored PartitionSpecs of gate_up and down (`MoeMLP.kernel_specs`): their shards
        over the shard_map's manual axes enter as they lie and are all-gathered inside, so the
        backward reduce-scatters the kernels' gradients into those shards (entering replicated, each
        device's whole gradient was all-reduced); None: gathered at the edge.
      block: with gmm, intermediate units per gathered block of the kernels (`model.expert_block_size`,
        `expert_blocks_for`); 0: whole kernels.

    Returns:
      [N, H] like x, rows over the batch axes.
    """
    manual = set(mesh.axis_names) if kernel != "ragged_dot" else set(BATCH_AXES)
    edge = [_edge_spec(spec, manual) for spec in (specs or (P("expert"), P("expert")))]
    blocks = expert_blocks_for(down.shape[1], block, edge) if kernel != "ragged_dot" else 1

    def local(x, experts, weights, gate_up, down):
        if blocks == 1:
            gate_up, down = gathered(gate_up, edge[0]), gathered(down, edge[1])
        gather = lambda a: jax.lax.all_gather(a, "expert", axis=0, tiled=True)  # noqa: E731
        x, experts, weights = gather(x), gather(experts), gather(weights)  # the expert group's rows
        per_device = gate_up.shape[0]
        first = jax.lax.axis_index("expert") * per_device
        mine = (experts >= first) & (experts < first + per_device)
        local_experts = jnp.where(mine, experts - first, per_device)  # others: the empty trailing group
        y = grouped_experts(x, local_experts, jnp.where(mine, weights, 0), gate_up, down, hidden_act, kernel,
                            blocks, tuple(edge))
        return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)

    rows = P(BATCH_AXES)
    if kernel != "ragged_dot":  # a Mosaic kernel: every axis manual
        return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, *edge),
                             out_specs=rows, check_vma=False)(x, experts, weights, gate_up, down)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, *edge), out_specs=rows,
                         axis_names=set(BATCH_AXES))(x, experts, weights, gate_up, down)


def _edge_spec(spec: P, manual: set[str]) -> P:
    """An expert kernel's in_spec: experts over `expert`, its other dims over the manual axes of its stored spec."""
    def kept(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else tuple(entry or ())) if a in manual and a != "expert")
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return P("expert", *(kept(entry) for entry in tuple(spec)[1:]))


def expert_blocks_for(intermediate: int, block: int, edge: list[P]) -> int:
    """How many blocks of the intermediate dim the experts' kernels are gathered in: `block_count` of
    `block` units when the shard_map gathers the kernels' hidden dim and their intermediate dim is whole
    on every device; else 1 (nothing gathered to split, or a tensor-parallel intermediate dim)."""
    def entry(spec, dim):
        return (tuple(spec) + (None,) * 3)[dim]

    gathers = entry(edge[0], 1) is not None or entry(edge[1], 2) is not None
    whole = entry(edge[0], 2) is None and entry(edge[1], 1) is None
    return block_count(intermediate, block) if gathers and whole else 1


def load_balancing_loss(probs: list[jnp.ndarray], experts: list[jnp.ndarray],
                        mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Switch-Transformer load-balancing loss over MoE layers (Fedus et al. 2021, eq. 4), as
    transformers' `load_balancing_loss_func`: `E * sum_e f_e * P_e` with f_e the share of top-k
    assignments to expert e and P_e its mean router probability, both over every layer's real tokens.

    Args:
      probs: per MoE layer [N, E] float32 router probabilities.
      experts: per MoE layer [N, k] int chosen experts.
      mask: [N] bool real tokens (None: all).

    Returns:
      [] float32 loss: k for perfectly balanced routing, E for top-1 routing of every token to one expert with certainty.
    """
    num_experts = probs[0].shape[-1]
    w = jnp.ones(probs[0].shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    counts = sum(jnp.sum(jax.nn.one_hot(e, num_experts, dtype=jnp.float32) * w[:, None, None], axis=(0, 1))
                 for e in experts)
    prob_sum = sum(jnp.sum(p.astype(jnp.float32) * w[:, None], axis=0) for p in probs)
    rows = jnp.maximum(jnp.sum(w) * len(probs), 1.0)
    return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


def routing_mismatch(recorded: jnp.ndarray, recomputed: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Share of real tokens whose expert set differs between two routings (order within the k ignored).

    Args:
      recorded: [..., N, k] int experts (e.g. the rollout's).
      recomputed: [..., N, k] int experts (e.g. the training forward's without replay).
      mask: [N] bool real tokens (None: all).

    Returns:
      [] float32 in [0, 1].
    """
    differs = jnp.any(jnp.sort(recorded, axis=-1) != jnp.sort(recomputed, axis=-1), axis=-1)  # [..., N]
    w = jnp.ones(differs.shape[-1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    w = jnp.broadcast_to(w, differs.shape)
    return jnp.sum(differs * w) / jnp.maximum(jnp.sum(w), 1.0)


class MoeMLP(nnx.Module):
    """Qwen3-MoE sparse feed-forward block: router + E SwiGLU experts (see the module docstring)."""

    def __init__(self, config, *, rngs: nnx.Rngs, param, normal):
        h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.hidden_act = config.hidden_act
        # The router's expert axis stays whole on every device (a small [H, E] matrix read by all rows).
        self.router_kernel = param(normal(rngs, (h, e), config.dtype), ("embed", None))
        self.gate_up = param(normal(rngs, (e, h, 2 * i), config.dtype), ("experts", "embed", "mlp"))
        self.down = param(normal(rngs, (e, i, h), config.dtype), ("experts", "mlp", "embed"))
        # Router replay: [N, k] experts for the next call's N tokens (set by `replay_routing`), or None.
        self.replay = nnx.data(None)
        # Record each call's routing as an nnx.Intermediate (`record_routing`); off by default, so
        # forwards inside the sampler's loops never write module state.
        self.record = False
        # Expert parallelism: the mesh whose `expert` axis splits the experts (set by
        # ShardingPlan.shard_activations; static, part of the graph definition), or None.
        self.expert_mesh = None
        # The training mesh when it has several devices (ShardingPlan.shard_activations), or None: a
        # Pallas grouped matmul runs under shard_map over it also without an expert axis.
        self.row_mesh = None
        # On a mesh: gate_up's and down's stored PartitionSpecs (ShardingPlan.shard_activations; static),
        # so the shard_map takes their shards as they lie (`expert_parallel_experts`), or None. A stacked
        # block's are one layer's (its [L, ...] specs without the layer axis): the scan body sees slices.
        self.kernel_specs = None
        # The grouped matmul (`rlbolt.models.moe_matmul.resolve_moe_matmul` of model.moe_matmul; static).
        self.matmul = "ragged_dot"
        # With gmm on a mesh that splits the kernels' hidden dim: intermediate units per gathered block
        # (model.expert_block_size, `rlbolt.models.expert_blocks`; static); 0: whole kernels.
        self.block_size = 0

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.routed(x)[0]

    def routed(self, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(output like x [..., H], the experts [N, k] int32 of its N = prod(x.shape[:-1]) tokens)."""
        x2 = x.reshape(-1, x.shape[-1])
        logits = jnp.dot(x2, self.router_kernel[...])
        weights, experts, probs = route(logits, self.top_k, self.norm_topk_prob, self.replay)
        if self.record:
            self.sow(nnx.Intermediate, "routing", (experts, probs))
        kernel = self.matmul
        mesh = self.expert_mesh if kernel == "ragged_dot" else (self.expert_mesh or self.row_mesh)
        gate_up, down = self.gate_up[...], self.down[...]
        if mesh is not None and x2.shape[0] % batch_shards(mesh) == 0:
            out = expert_parallel_experts(x2, experts, weights, gate_up, down, self.hidden_act, mesh, kernel,
                                          getattr(self, "kernel_specs", None), getattr(self, "block_size", 0))
        elif mesh is not None and kernel != "ragged_dot":  # rows that do not split: every device all rows
            out = jax.shard_map(functools.partial(grouped_experts, hidden_act=self.hidden_act, kernel=kernel),
                                mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(
                x2, experts, weights, gate_up, down)
        else:  # no mesh, no expert axis, or rows that do not split (XLA then gathers the experts' weights)
            out = grouped_experts(x2, experts, weights, gate_up, down, self.hidden_act, kernel)
        return out.reshape(x.shape), experts


def moe_layers(model) -> list[MoeMLP]:
    """The MoE blocks of a Decoder, in layer order, to set their static settings on.

    Where the layers are stored stacked (`rlbolt.models.stacked_layers`), the one stacked block (its
    kernels [L, E, ...]): it stands for every layer, and what is set on it reaches each layer's slice
    (the scan body, the `model.layers[i]` views) through the graph definition. Iterating
    `model.layers` there would set it on read-only views, where it is lost.
    """
    if is_stacked(model):
        mlp = model.layers.block.mlp
        return [mlp] if isinstance(mlp, MoeMLP) else []
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoeMLP)]


def _per_layer_routing(model, what: str) -> None:
    """Refuses routing set per layer on a model whose layers are stored stacked (one block for all)."""
    if is_stacked(model) and moe_layers(model):
        raise ValueError(f"{what}: this model's mixture-of-experts layers are stored stacked (model.scan_layers), one "
                         "block for every layer, so their routing cannot be set per layer; a run that records or "
                         "replays routing keeps them stored per layer (scan_layers.stack_reason)")


def replay_routing(model, experts: list[jnp.ndarray] | None) -> None:
    """Forces the next forward's routing: `experts[j]` ([N, k]) for the j-th MoE layer; None clears.

    N must be the token count of that forward in its own order (rows x positions flattened).

    Raises:
      ValueError: routing given for a model whose MoE layers are stored stacked.
    """
    if experts is not None:
        _per_layer_routing(model, "replay_routing")
    blocks = moe_layers(model)
    if experts is not None and len(experts) != len(blocks):
        raise ValueError(f"replay_routing: got routing for {len(experts)} layers, the model has {len(blocks)} "
                         "MoE layers.")
    for j, block in enumerate(blocks):
        block.replay = None if experts is None else experts[j]


def record_routing(model, on: bool = True) -> None:
    """Makes every MoE block of `model` record its routing on each call (read with `pop_routing`).

    Raises:
      ValueError: `on` for a model whose MoE layers are stored stacked.
    """
    if on:
        _per_layer_routing(model, "record_routing")
    for block in moe_layers(model):
        block.record = on


def pop_routing(model) -> tuple[list[jnp.ndarray], list[jnp.ndarray]]:
    """(experts per MoE layer [N, k], router probabilities per MoE layer [N, E]) recorded since the
    last pop, for the last forward (earlier calls' records are dropped)."""
    records = nnx.pop(model, nnx.Intermediate)
    experts, probs = [], []
    for path, value in sorted(nnx.to_flat_state(records), key=lambda item: tuple(str(p) for p in item[0])):
        if path[-1] != "routing":
            continue
        last = value.get_value()[-1]
        experts.append(last[0])
        probs.append(last[1])
    return experts, probs


def dense_reference(x, router_kernel, gate_up, down, top_k, norm_topk_prob):
    """float64 NumPy: every expert on every token, weighted by the routing (for tests)."""
    x, wr, gu, dn = (np.asarray(a, np.float64) for a in (x, router_kernel, gate_up, down))
    logits = x @ wr
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    top = np.take_along_axis(probs, experts, -1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(gu.shape[0]):
        g, u = np.split(x @ gu[e], 2, axis=-1)
        y = (g / (1 + np.exp(-g)) * u) @ dn[e]
        w = np.where(experts == e, top, 0.0).sum(-1, keepdims=True)
        out += w * y
    return out, experts
