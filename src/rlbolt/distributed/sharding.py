"""ShardingPlan: where the arrays of one role (training, rollout, reference) live on a mesh.

Parameters carry logical axis names (`("embed", "qkv")`, ... see `rlbolt.models.decoder`);
`rules` map each name to mesh axes. Batches put their sample axis over the batch axes
`data x fsdp x expert` and replicate the rest. Three conventions for host data, all exact copies:

- `put_full(x, ...)`: every process holds the whole array (the trained global batch);
- `put_local(x, ...)`: each process holds only its rows, its *data share* (rollout, logps);
- `local_rows(y)` / `host_value(y)`: back to NumPy, this process's rows / a replicated value.

A dimension that does not divide the mesh axes its rule names is replicated over them instead
(it is listed in `ShardingPlan.notes` and the memory plan shows the cost). Grouped-query models
whose key/value heads do not divide `tp` are the common case: their K/V projections and KV
cache are then replicated across the `tp` group, as Megatron and vLLM do.

One plan per role; today every role uses the trainer's plan (colocated), and a run that
places roles on sub-meshes gives each role its own plan over its own mesh.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlbolt.distributed.mesh import (AXES, BATCH_AXES, MeshError, as_mesh, batch_shards, describe, lacks_unit_axes,
                                    mesh_processes)

log = logging.getLogger(__name__)

# Logical axis -> mesh axes. "batch" is the sample axis of every batch and activation.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("qkv", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("head_dim", None),
    ("experts", "expert"),  # a mixture of experts' stacked expert weights [E, ...]
    ("layers", None),  # the leading axis of layers stored stacked (rlbolt.models.stacked_layers): every device holds all
)


class ShardingPlan:
    """A mesh plus the logical-axis rules that place one role's parameters and batches on it.

    Args:
      mesh: a `jax.sharding.Mesh` with axes `data`, `fsdp`, `tp` (see `MeshSpec.build`).
      rules: `(logical name, mesh axis | tuple of mesh axes | None)` pairs; names without a
        rule are replicated.

    Attributes:
      mesh: the mesh.
      batch_shards: pieces the sample axis is cut into (data x fsdp).
      share: this process's `DataShare` (which rows of each batch it produces and reads).
      notes: dimensions replicated because they do not divide their mesh axes.
    """

    def __init__(self, mesh: Mesh, rules: Sequence[tuple[str, Any]] = DEFAULT_RULES):
        if lacks_unit_axes(mesh):
            mesh = as_mesh(mesh)  # a mesh from before the expert / context axes: them with size 1 added
        self.mesh, self.rules = mesh, tuple(rules)
        self._rule = {name: _axes_tuple(axes) for name, axes in self.rules}
        unknown = sorted({a for axes in self._rule.values() for a in axes} - set(mesh.axis_names))
        if unknown:
            raise MeshError(f"sharding rules name mesh axes {unknown} that the mesh {mesh.axis_names} lacks")
        self.batch_shards = batch_shards(mesh)
        self.share = DataShare.of(mesh)
        self.notes: list[str] = []
        self.replicated = NamedSharding(mesh, P())

    def __repr__(self) -> str:
        return f"ShardingPlan({describe(self.mesh)})"

    # -- parameters ------------------------------------------------------------------------
    def spec_for(self, logical: Sequence[str | None], shape: Sequence[int], where: str = "") -> P:
        """The mesh PartitionSpec of an array with these logical axis names and shape."""
        out = []
        for name, size in zip(logical, shape):
            axes = self._rule.get(name, ()) if name is not None else ()
            axes = tuple(a for a in axes if self.mesh.shape[a] > 1)
            ways = math.prod(self.mesh.shape[a] for a in axes)
            if axes and size % ways:
                note = f"{name}={size} does not divide {'x'.join(axes)}={ways}: replicated over it"
                if not any(n.startswith(note) for n in self.notes):  # once per dimension, not per array
                    self.notes.append(f"{note} (e.g. {where or 'an array'})")
                    log.info("sharding: %s", self.notes[-1])
                axes = ()
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)

    def param_shardings(self, tree: Any) -> Any:
        """NamedShardings for a pytree of parameters (or of anything holding them, such as an
        optax state): `nnx.Variable` leaves use their `out_sharding` logical names, other arrays
        are replicated."""

        def one(path, leaf):
            logical = _logical_axes(leaf)
            value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            shape = getattr(value, "shape", ())
            spec = self.spec_for(logical, shape, jax.tree_util.keystr(path)) if logical else P()
            sharding = NamedSharding(self.mesh, spec)
            return leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding

        return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def place(self, tree: Any, shardings: Any = None) -> Any:
        """`tree` with every array on its sharding (default: `param_shardings(tree)`); arrays
        already there are returned as they are, so placing twice costs nothing."""
        shardings = self.param_shardings(tree) if shardings is None else shardings
        return jax.tree.map(_put, tree, shardings)

    def build_module(self, create: Callable[[], nnx.Module]) -> nnx.Module:
        """`create()` (an nnx module constructor) with every variable computed directly into its
        sharding: each device initialises only its shards, so no device ever holds the whole model."""
        graphdef, abstract = nnx.split(nnx.eval_shape(create))
        state = jax.jit(lambda: nnx.split(create())[1], out_shardings=self.param_shardings(abstract))()
        return nnx.merge(graphdef, state)

    def shard_activations(self, model: nnx.Module) -> nnx.Module:
        """Tells an `rlbolt.models.Decoder` to keep its residual stream's rows over the batch axes
        (and its tokens over `context` when mesh.context > 1),
        and its mixture-of-experts blocks to run their experts split over `expert` (static
        settings: take `nnx.split(model)` after this). Returns the model.

        Raises:
          MeshError: mesh.expert > 1 for a dense model, or one that does not divide its experts.
        """
        self._expert_parallel(model)
        if hasattr(model, "activation_sharding"):  # every setting, each time: a view may carry another mesh's
            model.activation_sharding = model.embedding_read_sharding = model.embedding_sharding = None
            model.token_sharding = model.mlp_weight_sharding = None
            if self.mesh.size > 1:
                model.activation_sharding = self.batch_sharding()
                if self.mesh.shape.get("context", 1) > 1:  # the token axis of [B, T, H] activations over context
                    model.token_sharding = NamedSharding(self.mesh, P(BATCH_AXES, "context"))
                table = model.embed.embedding.get_value()
                vocab = self.spec_for(("vocab",), table.shape[:1], "embed.embedding")[0]
                model.embedding_read_sharding = NamedSharding(self.mesh, P(vocab, None))
                model.embedding_sharding = NamedSharding(self.mesh, self.spec_for(
                    _logical_axes(model.embed.embedding), table.shape, "embed.embedding"))
                model.mlp_weight_sharding = self._mlp_weight_sharding(model.config)
        return model

    def _mlp_weight_sharding(self, config) -> NamedSharding | None:
        """The dense MLP's gate|up [H, 2I] stored sharding when it splits H and not 2I (the weight
        blocks of `rlbolt.models.mlp_blocks`), else None."""
        shape = (config.hidden_size, 2 * config.intermediate_size)
        spec = tuple(self.spec_for(("embed", "mlp"), shape, "mlp.gate_up_proj")) + (None, None)
        return NamedSharding(self.mesh, P(spec[0], None)) if spec[0] is not None and spec[1] is None else None

    def _expert_parallel(self, model: nnx.Module) -> None:
        ways = self.mesh.shape["expert"]
        blocks, stacked = _moe_blocks(model)
        for mlp in blocks:  # a Pallas grouped matmul runs under shard_map over this mesh
            mlp.row_mesh = self.mesh if self.mesh.size > 1 else None
            # One layer's stored specs: a stacked block's [L, ...] kernels lose their leading (layer) axis,
            # since the scan body and the views see one layer's slices.
            mlp.kernel_specs = None if self.mesh.size == 1 else tuple(
                P(*tuple(self.spec_for(_logical_axes(v), v.get_value().shape, "mlp.experts"))[stacked:])
                for v in (mlp.gate_up, mlp.down))
        if ways == 1 or not hasattr(model, "config"):
            for mlp in blocks:  # a view of a model placed elsewhere: not that mesh's experts
                mlp.expert_mesh = None
            return
        experts = getattr(model.config, "num_experts", 0)
        if not experts:
            raise MeshError(f"mesh.expert={ways} splits the experts of a mixture-of-experts model, but this model is "
                            "dense; move those devices to mesh.data or mesh.fsdp (mesh.expert=1)")
        if experts % ways:
            raise MeshError(f"mesh.expert={ways} does not divide the model's num_experts={experts}; choose a "
                            f"mesh.expert that divides {experts} (each device holds num_experts / mesh.expert)")
        for mlp in blocks:
            mlp.expert_mesh = self.mesh

    # -- batches ---------------------------------------------------------------------------
    def batch_sharding(self, sample_dim: int = 0) -> NamedSharding:
        """Sample axis `sample_dim` over data x fsdp x expert, every other dimension replicated."""
        return NamedSharding(self.mesh, P(*([None] * sample_dim), BATCH_AXES))

    def put_full(self, tree: Any, sample_dim: int = 0) -> Any:
        """Host arrays that every process holds whole -> global arrays with the sample axis sharded."""
        sharding = self.batch_sharding(sample_dim)
        return jax.tree.map(lambda x: _put(np.asarray(x), sharding), tree)

    def put_local(self, tree: Any, sample_dim: int = 0) -> Any:
        """This process's rows (its data share) -> global arrays; every process passes the same
        number of rows, and together they make the batch in share order."""
        sharding = self.batch_sharding(sample_dim)
        if jax.process_count() == 1:
            return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), tree)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)

    def local_rows(self, tree: Any, sample_dim: int = 0) -> Any:
        """Global batch-sharded arrays -> NumPy arrays of this process's rows (its data share)."""
        return jax.tree.map(lambda x: _local_rows(x, sample_dim), tree)

    def check_divides(self, name: str, size: int) -> None:
        """Raises a MeshError when a batch of `size` samples cannot be split over the batch shards."""
        if size % self.batch_shards:
            raise MeshError(f"{name}={size} cannot be split over the mesh's {self.batch_shards} batch shards "
                            f"(data x fsdp x expert: {describe(self.mesh)}); use a multiple of {self.batch_shards}, or "
                            "move devices to mesh.tp")


class DataShare:
    """Which part of every batch this process produces: rank `rank` of `size` equal blocks.

    Processes whose devices hold the same rows of a batch-sharded array (a `tp` group spanning
    hosts) share a rank and produce the same rows; on one process the share is (0, 1).

    Args:
      rank: this process's block.
      size: how many distinct blocks the processes hold.
      processes: the processes of the mesh the share is of (its collectives run among them only:
        `rlbolt.distributed.agree`); None: every process.
    """

    def __init__(self, rank: int = 0, size: int = 1, processes: tuple[int, ...] | None = None):
        self.rank, self.size, self.processes = rank, size, processes

    def __repr__(self) -> str:
        return f"DataShare(rank={self.rank}, size={self.size})"

    @classmethod
    def of(cls, mesh: Mesh) -> DataShare:
        """The share of this process under `mesh`'s batch sharding (for a described slice that this
        process is not part of: process 0's share of that slice's processes)."""
        if mesh_processes(mesh) == 1:
            return cls()
        shards = batch_shards(mesh)
        index_map = NamedSharding(mesh, P(BATCH_AXES)).devices_indices_map((shards,))
        rows: dict[int, set[int]] = {}
        for device, (index,) in index_map.items():
            rows.setdefault(device.process_index, set()).update(range(*index.indices(shards)))
        blocks = sorted({tuple(sorted(r)) for r in rows.values()})
        flat = [i for block in blocks for i in block]
        if flat != list(range(shards)) or any(b != tuple(range(b[0], b[0] + len(b))) for b in blocks) \
                or len({len(b) for b in blocks}) != 1:
            raise MeshError(f"mesh {describe(mesh)} gives the processes overlapping or scattered rows of the batch "
                            f"({[list(b) for b in blocks]}); keep each host's devices together on data x fsdp "
                            "(build the mesh with MeshSpec(...).build(), tp inside a host)")
        mine = rows.get(jax.process_index(), rows[min(rows)])
        return cls(blocks.index(tuple(sorted(mine))), len(blocks), tuple(sorted(rows)))

    def range(self, count: int) -> tuple[int, int]:
        """[start, stop) of this process's part of `count` items (equal parts; `count` must divide)."""
        if count % self.size:
            raise ValueError(f"{count} items cannot be split equally over {self.size} data shares (processes)")
        part = count // self.size
        return self.rank * part, (self.rank + 1) * part


# -- helpers ---------------------------------------------------------------------------------------
def _axes_tuple(axes: Any) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _moe_blocks(model: Any) -> tuple[list[Any], int]:
    """(the mixture-of-experts blocks of a Decoder to set, 1 when they are stored stacked else 0).

    Stored stacked (rlbolt.models.stacked_layers), the one block whose kernels are [L, E, ...]: its
    settings reach every layer through the graph definition, where `model.layers[i]` are read-only
    views (`rlbolt.models.moe.moe_layers`, duck-typed here: distributed does not import models).
    """
    layers = getattr(model, "layers", ())
    if type(layers).__name__ == "StackedLayers":
        mlp = getattr(layers.block, "mlp", None)
        return ([mlp] if hasattr(mlp, "expert_mesh") else []), 1
    return [layer.mlp for layer in layers if hasattr(getattr(layer, "mlp", None), "expert_mesh")], 0


def _logical_axes(leaf: Any) -> tuple | None:
    if not isinstance(leaf, nnx.Variable):
        return None
    names = leaf.get_metadata().get("out_sharding")
    return tuple(names) if names else None


def _put(x: Any, sharding: Any) -> Any:
    if isinstance(sharding, nnx.Variable):  # param_shardings keeps Variable leaves; a tree.map sees values
        sharding = sharding.get_value()
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract run (rlbolt.planning): the value with its sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not sharding.addressable_devices and jax.process_count() > 1:  # another process group's mesh: no shard here
        return jax.make_array_from_single_device_arrays(np.shape(x), sharding, [], dtype=x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    if isinstance(x, jax.Array) and not x.addressable_shards and jax.process_count() > 1:
        # x lives on another process group only: moving it is a transfer that group would have to join
        # (it runs other programs). Keep the shape; the value arrives by the group's own push.
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # the same value on every process (same seed, same file, same batch)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _local_rows(x: Any, sample_dim: int) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    pieces: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = shard.index[sample_dim].start or 0
        pieces.setdefault(start, np.asarray(shard.data))  # replicas of a block are equal
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=sample_dim)


def host_value(x: Any) -> Any:
    """A replicated (or fully addressable) array as NumPy, on any process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def host_tree(tree: Any) -> Any:
    """`host_value` over a pytree (the step's metrics), as one `jax.device_get` (the copies
    start together instead of one blocking fetch per leaf)."""
    local = lambda x: x.addressable_data(0) if isinstance(x, jax.Array) and not x.is_fully_addressable else x  # noqa: E731
    return jax.device_get(jax.tree.map(local, tree))


def gather_to_host(tree: Any) -> Any:
    """Whole NumPy copies of a pytree's arrays on every process (a collective for arrays that
    span processes: every process must call it)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays or ShapeDtypeStructs with shardings
    (the largest per-device total when shards are uneven)."""
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        itemsize = np.dtype(leaf.dtype).itemsize
        if sharding is None:
            totals[None] = totals.get(None, 0) + int(np.prod(leaf.shape)) * itemsize
            continue
        for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
            shape = [len(range(*s.indices(n))) for s, n in zip(index, leaf.shape)]
            totals[device] = totals.get(device, 0) + int(np.prod(shape)) * itemsize
    shared = totals.pop(None, 0)
    return shared + (max(totals.values()) if totals else 0)


__all__ = ["AXES", "DEFAULT_RULES", "DataShare", "ShardingPlan", "gather_to_host", "host_tree", "host_value",
           "per_device_bytes"]
