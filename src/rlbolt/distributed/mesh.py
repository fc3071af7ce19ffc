"""MeshSpec: the device mesh of a run, `data x fsdp x expert x context x tp`, with -1 meaning "the rest".

    data   pure data parallelism: every `data` slice holds the full (fsdp-sharded) model and its
           own part of the batch; gradients are averaged across slices.
    fsdp   fully sharded data parallelism: the batch is split over it too, and parameters,
           gradients and optimizer state are sharded over it (gathered one layer at a time).
    expert expert parallelism (mixture-of-experts models): the experts' stacked weights are split
           over it (each device holds E / expert of them) and the batch is split over it too, so
           for every other weight it is one more data-parallel axis (`rlbolt.models.moe`).
    context context parallelism: the token axis of each sequence is split over it (training and
           log-prob forwards; attention runs as a ring, `rlbolt.models.context_attention`);
           parameters and the batch are not split over it (every device of a context group
           holds the same rows, each a part of their tokens).
    tp     tensor parallelism: attention heads, MLP columns and the vocabulary are split over it;
           the batch is not.

The sample axis of every batch is split over `data x fsdp x expert` ("batch shards"). The axes
are laid out in that order, `tp` fastest, so on a multi-host slice the devices of one `tp` group sit on
one host (tensor parallelism is the most communication-hungry axis), then `context` (the ring's
neighbours next to each other).

One device is the 1 x 1 x 1 mesh: the same code path runs everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "expert", "context", "tp")
# Axes a mesh built before they existed may lack: added with size 1 (`as_mesh`).
UNIT_AXES = ("expert", "context")
BATCH_AXES = ("data", "fsdp", "expert")


class MeshError(ValueError):
    """A mesh shape that does not fit the devices (the message names the axes and the fix)."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The shape of the device mesh; at most one axis may be -1 ("all devices left").

    Args:
      data: data-parallel replicas.
      fsdp: fully-sharded data-parallel shards (default -1: every device not used by the others).
      tp: tensor-parallel shards.
      expert: expert-parallel shards (mixture-of-experts models; must divide the experts).
      context: context-parallel shards: each sequence's tokens split over them (ring attention).
    """

    data: int = 1
    fsdp: int = -1
    tp: int = 1
    expert: int = 1
    context: int = 1

    @classmethod
    def of(cls, value: MeshSpec | Mapping[str, int] | None) -> MeshSpec:
        """A MeshSpec from itself, a `{data, fsdp, expert, context, tp}` mapping (missing axes take the defaults), or None."""
        if value is None:
            return cls()
        if isinstance(value, MeshSpec):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(AXES))
            if unknown:
                raise MeshError(f"mesh has unknown axes {unknown}; the axes are {list(AXES)} (-1 = the rest)")
            return cls(**{k: value[k] for k in AXES if k in value})
        raise TypeError(f"mesh={value!r}: pass a MeshSpec, a {{data, fsdp, expert, context, tp}} dict, a jax.sharding.Mesh or None")

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """The axis sizes for `num_devices` devices, -1 filled in, in `AXES` order.

        Raises:
          MeshError: a size below -1 or 0, more than one -1, or a product that is not the device count.
        """
        sizes = {name: getattr(self, name) for name in AXES}
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size == 0 or size < -1:
                raise MeshError(f"mesh.{name}={size!r} must be a positive integer or -1 (the devices left)")
        free = [name for name, size in sizes.items() if size == -1]
        if len(free) > 1:
            raise MeshError(f"mesh has -1 for {free}; at most one axis can take 'the rest' of the {num_devices} devices")
        fixed = math.prod(size for size in sizes.values() if size != -1)
        if free:
            if num_devices % fixed:
                raise MeshError(f"mesh {self._text()}: {num_devices} devices cannot be split into a multiple of "
                                f"{fixed}; choose sizes whose product divides {num_devices}")
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise MeshError(f"mesh {self._text()} needs {fixed} devices but {num_devices} are visible; make "
                            f"data x fsdp x expert x context x tp = {num_devices} (or set one axis to -1)")
        return tuple(sizes[name] for name in AXES)

    def build(self, devices: Sequence[Any] | None = None) -> Mesh:
        """The `jax.sharding.Mesh` over `devices` (default: every device of every process).

        Axes use `AxisType.Auto`: XLA's partitioner propagates the shardings that rlbolt sets on
        parameters, batches and outputs through the rest of each computation.
        """
        devices = list(jax.devices() if devices is None else devices)
        shape = self.resolve(len(devices))
        auto = (AxisType.Auto,) * len(AXES)  # jax.make_mesh's default is Explicit: rlbolt's code needs Auto
        if devices == list(jax.devices()):
            # jax.make_mesh orders devices by the physical topology (TPU/GPU interconnect).
            return _hosts_together(jax.make_mesh(shape, AXES, axis_types=auto))
        from rlbolt.distributed.topology import is_abstract

        if is_abstract(devices):  # a described slice (rlbolt plan --topology): ordered by its topology too
            return _hosts_together(jax.make_mesh(shape, AXES, axis_types=auto, devices=devices))
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES,
                    axis_types=(AxisType.Auto,) * len(AXES))

    def _text(self) -> str:
        shown = [name for name in AXES if name != "context" or self.context != 1]  # context only when in use
        return "{" + ", ".join(f"{name}: {getattr(self, name)}" for name in shown) + "}"


def _hosts_together(mesh: Mesh) -> Mesh:
    """`mesh` with each process's devices consecutive in the flat order (the physical order kept
    within a process). jax.make_mesh may interleave hosts (a v5p:2x2x2 ring alternates its two
    hosts' chips), which gives every process scattered rows of the batch (`DataShare` refuses
    that); one process's devices, or hosts already consecutive, are returned as they are."""
    flat = list(mesh.devices.flat)
    owners = [d.process_index for d in flat]
    if owners == sorted(owners):
        return mesh
    order = sorted(range(len(flat)), key=lambda i: (owners[i], i))
    return Mesh(np.asarray([flat[i] for i in order], dtype=object).reshape(mesh.devices.shape), mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def as_mesh(mesh: Mesh | MeshSpec | Mapping[str, int] | None, devices: Sequence[Any] | None = None) -> Mesh:
    """A `jax.sharding.Mesh` from a Mesh (returned as is; it must have rlbolt's axis names; one
    without `expert` or `context` gets them with size 1), a MeshSpec, a `{data, fsdp, expert, context,
    tp}` dict, or None (all devices on `fsdp`)."""
    if isinstance(mesh, Mesh):
        if lacks_unit_axes(mesh):
            mesh = _with_unit_axes(mesh)
        missing = [a for a in AXES if a not in mesh.axis_names]
        extra = [a for a in mesh.axis_names if a not in AXES]
        if missing or extra:
            raise MeshError(f"mesh axes {list(mesh.axis_names)}: rlbolt's rules use exactly {list(AXES)} (size 1 "
                            f"for an unused axis); build it with MeshSpec(...).build() or jax.make_mesh(shape, {AXES})")
        return mesh
    return MeshSpec.of(mesh).build(devices)


def lacks_unit_axes(mesh: Any) -> bool:
    """True for a Mesh with rlbolt's axes except some of UNIT_AXES (one built before they existed)."""
    names = set(mesh.axis_names)
    return isinstance(mesh, Mesh) and names < set(AXES) and set(AXES) - names <= set(UNIT_AXES)


def _with_unit_axes(mesh: Mesh) -> Mesh:
    """`mesh` (rlbolt's axes in any order, some of UNIT_AXES missing) with those axes of size 1, in AXES order."""
    present = [a for a in AXES if a in mesh.axis_names]
    devices = mesh.devices.transpose([mesh.axis_names.index(a) for a in present])
    shape = [mesh.shape[a] if a in mesh.axis_names else 1 for a in AXES]
    return Mesh(devices.reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_processes(mesh: Any) -> int:
    """How many processes own the mesh's devices (1 for an AbstractMesh, which has none): the
    target slice's count when planning, not this host's `jax.process_count()`."""
    try:
        return len({d.process_index for d in mesh.devices.flat})
    except ValueError:  # jax.sharding.AbstractMesh: shapes only
        return 1


def batch_shards(mesh: Mesh) -> int:
    """How many pieces the sample axis is cut into: data x fsdp x expert."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def describe(mesh: Mesh) -> str:
    """`data=2 fsdp=2 expert=1 tp=2 (8 devices, 2 processes)`; `context=n` shown when n > 1."""
    sizes = " ".join(f"{a}={mesh.shape[a]}" for a in AXES
                     if a in mesh.shape and (a != "context" or mesh.shape[a] > 1))
    processes = len({d.process_index for d in mesh.devices.flat})
    return f"{sizes} ({mesh.devices.size} devices, {processes} process{'es' if processes > 1 else ''})"
