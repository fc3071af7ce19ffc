"""Placement: which devices each role uses, and the weight sync from training to rollout.

    placement = Placement.of("colocated")             every role on the trainer's one mesh (default)
    placement = Placement.of({"train": {"devices": [0, 4]},
                              "rollout": {"devices": [4, 8], "mesh": {"tp": 2}},
                              "reference": "train"})  disaggregated: roles on their own sub-meshes
                                                      (teacher: the same choice as reference)
    plans = placement.plans(mesh)                     role -> ShardingPlan
    sync = WeightSync(plans["train"], plans["rollout"])
    rollout_params = sync(params)                     reshard, shard by shard, onto the rollout mesh

A role's `devices` is a `[start, stop)` range of `jax.devices()`; its `mesh` a `{data, fsdp,
tp}` shape over them (default: all on fsdp). `reference` is "train" (the default: the reference
forward runs in the logps stage on the training devices) or a range of its own, disjoint from
train's and rollout's: the module then keeps its frozen reference copy only there and runs the
reference forward there. `teacher` (on-policy distillation's teacher) is placed the same way:
"train" (the default) or a range of its own, disjoint from every other role's. Roles on their own
devices run at once: the rollout of step k+1 while step k's update runs (async mode), instead of
taking turns on one device set.

The weight sync never gathers a parameter onto one device: each leaf is first laid out on the
training devices as the rollout mesh wants it (a jitted reshard within the training devices,
each device computing only its target shard), then every shard is copied to the rollout device
that holds that part (`jax.device_put` finds a source buffer with exactly that index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from rlbolt.distributed.mesh import AXES, MeshError, MeshSpec
from rlbolt.distributed.sharding import ShardingPlan

ROLES = ("train", "rollout", "reference", "teacher")
FROZEN_ROLES = ("reference", "teacher")  # forwards of frozen models: "train" or devices of their own


@dataclasses.dataclass(frozen=True)
class RoleMesh:
    """One role's devices (`[start, stop)` of `jax.devices()`) and mesh shape over them."""

    start: int
    stop: int
    mesh: MeshSpec = MeshSpec()


@dataclasses.dataclass(frozen=True)
class Placement:
    """Colocated (`roles` empty) or disaggregated: role -> RoleMesh (see the module docstring)."""

    roles: Mapping[str, RoleMesh] = dataclasses.field(default_factory=dict)

    @property
    def colocated(self) -> bool:
        return not self.roles

    @classmethod
    def of(cls, value: Any) -> Placement:
        """A Placement from itself, "colocated" / None, or a mapping role -> `{devices: [start,
        stop], mesh: {data, fsdp, tp}}` for train and rollout; reference and teacher: "train" (the
        default) or such a map of their own.

        Raises:
          MeshError: one line naming the field, the value and the fix.
        """
        if isinstance(value, Placement):
            return value
        if value is None or value == "colocated":
            return cls()
        if not isinstance(value, Mapping):
            raise MeshError(f"placement={value!r}: use 'colocated' or a map role -> {{devices: [start, stop], mesh: "
                            f"{{data, fsdp, tp}}}} for the roles {list(ROLES)}")
        unknown = sorted(set(value) - set(ROLES))
        if unknown:
            raise MeshError(f"placement has unknown role(s) {unknown}; the roles are {list(ROLES)}")
        missing = [r for r in ("train", "rollout") if r not in value]
        if missing:
            raise MeshError(f"placement names no devices for {missing}; give train and rollout each a "
                            "{devices: [start, stop]} range (reference defaults to train's)")
        roles = {r: _role(r, value[r]) for r in ("train", "rollout")}
        for frozen in FROZEN_ROLES:
            where = value.get(frozen, "train")
            if isinstance(where, str) and where != "train":
                raise MeshError(f"placement.{frozen}={where!r}: use {frozen}: train (the {frozen} forward runs on "
                                "train's devices) or {devices: [start, stop]} disjoint from the other roles'")
            roles[frozen] = roles["train"] if where == "train" else _role(frozen, where)
        _check_disjoint(roles)
        return cls(roles)

    @property
    def reference_apart(self) -> bool:
        """True when the reference has devices of its own (not train's)."""
        return not self.colocated and self.roles["reference"] is not self.roles["train"]

    def plans(self, mesh: Any = None, devices: Any = None) -> dict[str, ShardingPlan]:
        """role -> ShardingPlan; colocated: one plan on `mesh` for every role.

        Args:
          mesh: the colocated mesh (MeshSpec, dict, Mesh, ShardingPlan or None).
          devices: the devices the ranges index (None: `jax.devices()`; a described slice's when planning).

        Raises:
          MeshError: a range past the visible devices, a mesh shape that does not fit its range,
            a placement across processes that is not run (`check_across_processes`), or a `mesh`
            besides it.
        """
        from rlbolt.distributed.layout import training_plan

        if self.colocated:
            plan = training_plan(mesh, devices)
            return dict.fromkeys(ROLES, plan)
        devices = list(jax.devices() if devices is None else devices)
        if len({d.process_index for d in devices}) > 1:
            self.check_across_processes(devices)
        if mesh is not None and (not isinstance(mesh, (Mapping, MeshSpec)) or MeshSpec.of(mesh) != MeshSpec()):
            raise MeshError(f"mesh={mesh!r} and a placement on sub-meshes: give each role's mesh in placement "
                            "(placement.<role>.mesh) and leave mesh at its default")
        built: dict[RoleMesh, ShardingPlan] = {}
        for role, where in self.roles.items():
            if where.stop > len(devices):
                raise MeshError(f"placement.{role}.devices=[{where.start}, {where.stop}] but {len(devices)} devices "
                                f"are visible; use ranges within [0, {len(devices)}]")
            if where not in built:  # roles that share a range share one plan
                built[where] = ShardingPlan(where.mesh.build(devices[where.start:where.stop]))
        return {role: built[where] for role, where in self.roles.items()}


    def check_across_processes(self, devices: Any) -> None:
        """What the Trainer runs across processes (`rlbolt.distributed.process_groups`): train and
        rollout on whole, disjoint processes, the reference and teacher with train, train holding
        the first process (it writes the run directory).

        Args:
          devices: the devices the ranges index (`jax.devices()`: ordered by process).

        Raises:
          MeshError: one line naming the groups, what is not run across processes, and the fix.
        """
        devices = list(devices)
        groups = self.process_groups(devices)  # a range that splits a process is named first
        named = ", ".join(f"{role} on {list(p)}" for role, p in groups.items())
        apart = [r for r in FROZEN_ROLES if self.roles[r] is not self.roles["train"]]
        if apart:
            raise MeshError(f"placement across processes ({named}): {apart[0]} on processes of its own is not run yet; "
                            f"use {apart[0]}: train")
        first = devices[0].process_index
        if first not in groups["train"]:
            raise MeshError(f"placement across processes ({named}): train must hold process {first}'s devices (it "
                            "writes the run directory); put train's range first")

    def process_groups(self, devices: Any) -> dict[str, tuple[int, ...]]:
        """role -> the processes whose devices it uses, for a placement across processes.

        Args:
          devices: the devices the ranges index (`jax.devices()`: ordered by process).

        Returns:
          Each role's process indices, in order (roles sharing train's range share its group).

        Raises:
          MeshError: a range past the devices, or one that takes only part of a process's devices
            (across processes a process runs one role's programs, so it belongs to one role).
        """
        devices = list(devices)
        groups = {}
        for role, where in self.roles.items():
            if where.stop > len(devices):
                raise MeshError(f"placement.{role}.devices=[{where.start}, {where.stop}] but {len(devices)} devices "
                                f"are visible; use ranges within [0, {len(devices)}]")
            inside = devices[where.start:where.stop]
            for process in sorted({d.process_index for d in inside}):
                owned = [i for i, d in enumerate(devices) if d.process_index == process]
                if not all(where.start <= i < where.stop for i in owned):
                    raise MeshError(f"placement.{role}.devices=[{where.start}, {where.stop}] takes part of process "
                                    f"{process}'s devices {owned}; across processes give each role whole processes")
            groups[role] = tuple(sorted({d.process_index for d in inside}))
        return groups


def _role(role: str, value: Any) -> RoleMesh:
    if not isinstance(value, Mapping) or "devices" not in value:
        raise MeshError(f"placement.{role}={value!r}: give {{devices: [start, stop]}} (and optionally mesh: "
                        "{data, fsdp, tp})")
    extra = sorted(set(value) - {"devices", "mesh"})
    if extra:
        raise MeshError(f"placement.{role} has unknown key(s) {extra}; the keys are devices and mesh")
    span = value["devices"]
    if (not isinstance(span, (list, tuple)) or len(span) != 2 or not all(isinstance(i, int) for i in span)
            or not 0 <= span[0] < span[1]):
        raise MeshError(f"placement.{role}.devices={span!r} must be [start, stop] with 0 <= start < stop "
                        "(device indices, stop excluded)")
    return RoleMesh(span[0], span[1], MeshSpec.of(value.get("mesh")))


def _check_disjoint(roles: Mapping[str, RoleMesh]) -> None:
    pairs = [("train", "rollout")]
    apart = [r for r in FROZEN_ROLES if roles[r] is not roles["train"]]
    for i, frozen in enumerate(apart):
        pairs += [("train", frozen), ("rollout", frozen), *((other, frozen) for other in apart[:i])]
    for x, y in pairs:
        a, b = roles[x], roles[y]
        if a.start < b.stop and b.start < a.stop:
            fix = "".join(f"use {r}: train to share train's devices, or " for r in FROZEN_ROLES if r == y)
            raise MeshError(f"placement: the devices of {x} [{a.start}, {a.stop}) and {y} [{b.start}, {b.stop}) "
                            f"overlap; {fix}give each its own range, or use placement: colocated")


class WeightSync:
    """Moves a parameter pytree from the training plan's devices onto the rollout plan's.

    Args:
      source: the plan the parameters live on (training).
      target: the plan they must reach (rollout).

    Raises:
      MeshError: the target's fsdp x expert x context x tp does not divide the source's device count (the shards
        could not be laid out on the source devices first).
    """

    def __init__(self, source: ShardingPlan, target: ShardingPlan):
        self.source, self.target = source, target
        shape = target.mesh.shape
        block = shape["fsdp"] * shape["expert"] * shape.get("context", 1) * shape["tp"]
        devices = list(source.mesh.devices.flat)
        if len(devices) % block:
            raise MeshError(f"placement: the rollout mesh's fsdp x expert x context x tp = {block} does not divide the "
                            f"{len(devices)} training devices, so its shards cannot be cut there first; choose sizes "
                            "that divide")
        self.staging_mesh = Mesh(np.asarray(devices, dtype=object).reshape(
            len(devices) // block, shape["fsdp"], shape["expert"], shape.get("context", 1), shape["tp"]),
            AXES, axis_types=(AxisType.Auto,) * len(AXES))
        self._stage: dict[Any, Any] = {}  # tree structure -> jitted reshard onto the staging layout

    def shardings(self, params: Any) -> tuple[Any, Any]:
        """(target NamedShardings, the same layouts on the training devices) for `params`."""
        target = jax.tree.map(lambda _, s: s, params, self.target.param_shardings(params))
        staging = jax.tree.map(lambda s: NamedSharding(self.staging_mesh, s.spec), target)
        return target, staging

    def stage_fn(self, params: Any):
        """The jitted reshard onto the staging layout (also used to read its compiled memory)."""
        key = jax.tree.structure(params)
        if key not in self._stage:
            _, staging = self.shardings(params)
            self._stage[key] = jax.jit(lambda tree: tree, out_shardings=staging)
        return self._stage[key]

    def __call__(self, params: Any) -> Any:
        """The parameters on the rollout mesh (dispatched asynchronously)."""
        target, _ = self.shardings(params)
        staged = self.stage_fn(params)(params)
        return jax.device_put(staged, target)
