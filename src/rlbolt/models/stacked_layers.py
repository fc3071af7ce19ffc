"""The decoder's uniform layers stored stacked (`model.scan_layers`): one module, a leading layer axis.

With `model.scan_layers` on and layers that can scan (`rlbolt.models.scan_layers.scan_reason` is
None), `stack_layers(model)` replaces the Decoder's `nnx.List` of L layers by a `StackedLayers`
whose `block` is ONE DecoderLayer holding every layer's parameters along a new leading axis:

    per layer (the external layout)              stacked (inside a scanned run)
    layers.{i}.attn.qkv_proj.kernel  [H, Q]      layers.block.attn.qkv_proj.kernel  [L, H, Q]
    logical axes ("embed", "qkv")                ("layers", "embed", "qkv")   ("layers": unsharded)

The scanned forward (`rlbolt.models.scan_layers.scanned_layers`) scans that state directly: no
per-forward copy of the layer weights, the gradient comes back stacked, and the optimizer sees
one leaf per parameter kind (not L of each). The passes that loop over the layers (decode with a
KV cache, the prompt-shared forward, routing) read `model.layers[i]`: a read-only view whose
variables are the i-th slices (inside a jitted pass, a slice of the stacked array) and whose static
attributes are the block's (one graph definition). Settings therefore go on the block, never on a
view (where they are lost): mixture-of-experts layers, stacked in a run without routing features
(`rlbolt.models.scan_layers.stack_reason`), get their grouped matmul and mesh on `block.mlp`
(`rlbolt.models.moe.moe_layers`, `ShardingPlan.shard_activations`), and per-layer routing (record,
replay) is refused on them.

Everything outside sees the per-layer layout, through the conversions at the boundaries, all here:
`flat_params` (`rlbolt.models.hf_layout`: Hugging Face / GGUF export, the vLLM weight push) and PEFT
export read per-layer names; checkpoints are saved as the run holds them and converted on restore
(`saved_layout`, `stack_layer_state` / `unstack_layer_state`), so a per-layer checkpoint resumes
into a stacked run and the reverse. Loaders build the per-layer model; stacking happens after.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

BLOCK = "block"  # the StackedLayers attribute (and state key) holding the stacked DecoderLayer
LAYER_AXIS = "layers"  # the logical name of the leading axis (replicated: no sharding rule maps it)


class StackedLayers(nnx.Module):
    """L structurally equal decoder layers stored as one: `block`'s parameters are [L, ...].

    Indexing and iteration give read-only per-layer views (`nnx.merge` of the i-th slices):
    what they compute is layer i's, but a value set on a view is not written back.

    Args:
      block: a DecoderLayer whose every variable carries a leading axis of size `count`.
      count: L, the number of layers.
    """

    def __init__(self, block: nnx.Module, count: int):
        self.block = block
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> nnx.Module:
        if not -self.count <= i < self.count:
            raise IndexError(f"layer {i} of {self.count}")
        graphdef, state = nnx.split(self.block)
        return nnx.merge(graphdef, _map_variables(lambda v: _take_variable(v, i % self.count), state))

    def __iter__(self) -> Iterator[nnx.Module]:
        return (self[i] for i in range(self.count))


def is_stacked(model: nnx.Module) -> bool:
    """Whether `model` holds its layers stacked.

    Args:
      model: a Decoder (anything without a StackedLayers `layers` attribute: False).
    """
    return isinstance(getattr(model, "layers", None), StackedLayers)


def stack_layers(model: nnx.Module) -> nnx.Module:
    """Replaces `model.layers` (an nnx.List of structurally equal layers) by a StackedLayers, in place.

    The stacked arrays are new (one copy of the layer weights while the per-layer ones are
    still referenced); call it before the model is placed and trained.

    Args:
      model: a Decoder whose layers can scan (`scan_reason(model)` is None); already stacked: unchanged.

    Returns:
      `model`.
    """
    if is_stacked(model):
        return model
    layers = list(model.layers)
    graphdef = nnx.graphdef(layers[0])
    if any(nnx.graphdef(layer) != graphdef for layer in layers[1:]):
        raise ValueError("stack_layers: the layers differ in structure; keep them per layer")
    states = [nnx.state(layer) for layer in layers]
    stacked = jax.tree.map(lambda *vs: _stack_variables(vs), *states, is_leaf=_is_variable)
    model.layers = StackedLayers(nnx.merge(graphdef, stacked), len(layers))
    return model


# ----------------------------------------------------------------------------- state trees


def unstack_layer_state(tree: Any) -> Any:
    """A tree in the per-layer layout: every `layers: {block: ...}` subtree becomes `layers: {0: ..., 1: ...}`.

    Works on nnx.State, nested dicts (a restored checkpoint) and trees holding them (an optax
    state), with arrays, nnx Variables or ShapeDtypeStructs as leaves; other subtrees are unchanged.

    Args:
      tree: the pytree.
    """
    def convert(layers: Mapping) -> Any:
        block = layers[BLOCK]
        count = _count(block)
        return type(layers)({i: _map_variables(lambda v: _take_variable(v, i), block) for i in range(count)})

    return _walk(tree, lambda layers: BLOCK in layers, convert)


def stack_layer_state(tree: Any) -> Any:
    """A tree in the stacked layout: every per-layer `layers: {0: ..., 1: ...}` subtree becomes `layers: {block: ...}`.

    The inverse of `unstack_layer_state` (keys may be ints, as in nnx.State, or their text, as in
    a checkpoint restored without a target).

    Args:
      tree: the pytree.
    """
    def convert(layers: Mapping) -> Any:
        per = [layers[k] for k in sorted(layers, key=int)]
        stacked = jax.tree.map(lambda *vs: _stack_variables(vs), *per, is_leaf=_is_variable)
        return type(layers)({BLOCK: stacked})

    return _walk(tree, _per_layer_keys, convert)


class LayerSlice:
    """Layer i of a stacked variable, sliced when read (`get_value`): export walks the layers one
    parameter at a time, so no second copy of the layer weights is made on the device.

    Args:
      variable: the stacked nnx Variable ([L, ...]).
      i: the layer.
    """

    def __init__(self, variable: nnx.Variable, i: int):
        self.variable, self.index = variable, i

    def get_value(self) -> Any:
        """The layer's array (a new slice at each call)."""
        return _take_value(self.variable.get_value(), self.index)

    def get_metadata(self) -> dict[str, Any]:
        """The variable's metadata, the leading "layers" axis dropped."""
        meta = dict(self.variable.get_metadata())
        if meta.get("out_sharding"):
            meta["out_sharding"] = tuple(meta["out_sharding"][1:])
        return meta


def flat_layer_slices(state: Any) -> list[tuple[tuple, Any]]:
    """`nnx.to_flat_state(state)` with every stacked `('layers', 'block', ...)` variable given as
    its per-layer `('layers', i, ...)` LayerSlices (read-only); other variables as they are.

    Args:
      state: an nnx.State of a Decoder, stacked or per layer.
    """
    out = []
    for path, variable in nnx.to_flat_state(state):
        if len(path) > 1 and path[0] == LAYER_AXIS and path[1] == BLOCK:
            out.extend(((LAYER_AXIS, i, *path[2:]), LayerSlice(variable, i)) for i in range(variable.shape[0]))
        else:
            out.append((path, variable))
    return out


def saved_layout(names: Iterable[str]) -> str | None:
    """"stacked", "per_layer" or None (no layers) for the array names of a checkpoint record.

    Args:
      names: array names as `rlbolt.checkpointing.integrity` writes them (`params/layers/block/...`
        or `params/layers/0/...`).
    """
    for name in names:
        parts = name.split("/")
        for j, part in enumerate(parts[:-1]):
            if part == LAYER_AXIS:
                if parts[j + 1] == BLOCK:
                    return "stacked"
                if parts[j + 1].isdigit():
                    return "per_layer"
    return None


def to_layout(tree: Any, layout: str | None) -> Any:
    """`tree` converted to `layout` ("stacked" / "per_layer"; None: unchanged).

    Args:
      tree: the pytree.
      layout: as `saved_layout` returns it.
    """
    if layout == "stacked":
        return stack_layer_state(tree)
    if layout == "per_layer":
        return unstack_layer_state(tree)
    return tree


def _per_layer_keys(layers: Mapping) -> bool:
    keys = list(layers)
    return bool(keys) and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in keys)


def _walk(tree: Any, match, convert) -> Any:
    """`tree` with `convert(node)` for every mapping stored under the key "layers" that `match`es."""
    if _is_variable(tree):
        return tree
    if isinstance(tree, nnx.State):  # its nested mappings are plain dicts (State wraps them on access)
        return type(tree)(_walk(tree.raw_mapping, match, convert))
    if isinstance(tree, Mapping):
        out = {}
        for key, value in tree.items():
            if key == LAYER_AXIS and isinstance(value, Mapping) and match(value):
                out[key] = convert(value)
            else:
                out[key] = _walk(value, match, convert)
        return type(tree)(out)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple (optax states)
        return type(tree)(*(_walk(v, match, convert) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_walk(v, match, convert) for v in tree)
    return tree


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _map_variables(fn, tree: Any) -> Any:
    """fn on every leaf of `tree`, a Variable taken whole."""
    return jax.tree.map(fn, tree, is_leaf=_is_variable)


def _count(block: Any) -> int:
    leaf = jax.tree.leaves(block)[0]
    return int(leaf.shape[0])


def _axes(variable: nnx.Variable) -> Any:
    return variable.get_metadata().get("out_sharding")


def _stack_variables(leaves: tuple) -> Any:
    """One leaf with a leading axis over `leaves` (Variables: their logical axes get "layers" in front)."""
    first = leaves[0]
    if not _is_variable(first):
        return _stack_values(leaves)
    value = _stack_values([v.get_value() for v in leaves])
    axes = _axes(first)
    return first.replace(value, out_sharding=(LAYER_AXIS, *axes)) if axes else first.replace(value)


def _take_variable(leaf: Any, i: int) -> Any:
    """Layer i's slice of a stacked leaf (Variables: the leading logical axis dropped)."""
    if not _is_variable(leaf):
        return _take_value(leaf, i)
    axes = _axes(leaf)
    value = _take_value(leaf.get_value(), i)
    return leaf.replace(value, out_sharding=tuple(axes[1:])) if axes else leaf.replace(value)


def _stack_values(values) -> Any:
    first = values[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(values), *first.shape), first.dtype, sharding=sharding)
    return jnp.stack(values)


def _take_value(value: Any, i: int) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct):
        sharding = value.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        return jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=sharding)
    return value[i]
