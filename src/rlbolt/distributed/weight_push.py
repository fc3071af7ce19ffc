"""The weight push between groups of processes: training processes -> rollout processes.

    push = ProcessWeightPush(train_plan, rollout_plan)     both plans span every process's view
    # on a training process:  push(params, policy_version)       -> (None, policy_version)
    # on a rollout process:   push(abstract_params)              -> (params on the rollout mesh, policy_version)

Both groups call it at the same point of their programs (it is one transfer with a sender and a
receiver side), the training group with its parameters, the rollout group with their abstract
shapes (`nnx.eval_shape`: shape, dtype and logical axes are all it needs). Processes in neither
group do not call it.

How: the training group first lays every leaf out on its own devices exactly as the rollout mesh
wants it (`WeightSync`'s staging reshard: a jitted identity within the training devices, each
computing only its target shards), then `jax.device_put` moves each shard to the rollout device
that holds the same index. Across processes that is JAX's cross-host transfer, which needs the
source and target shardings to be the same layout over the same number of devices (hence equal
device counts in both groups for now) and, on backends without a native cross-host path (CPU,
GPU), a transfer socket per process: `jax_cross_host_transfer_socket_address`, set by
`rlbolt.distributed.initialize` from `$RLBOLT_TRANSFER_ADDRESS` (`rlbolt launch` sets it).
The policy version travels with the weights as a replicated int32 scalar, so a rollout process
knows which weights it holds without a second channel. Why this transport and not
`jax.experimental.transfer` (measured): docs/howto/multi-host.md.

Where every process runs the same program and so holds the training arrays (without local
shards off the training group), `WeightSync` alone does the same move: a process outside a
sub-mesh may call its jitted programs (nothing runs there). This class is for programs that
differ by group, where the rollout processes have no training arrays to pass.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rlbolt.distributed.mesh import MeshError
from rlbolt.distributed.placement import WeightSync
from rlbolt.distributed.sharding import ShardingPlan


def plan_processes(plan: ShardingPlan) -> frozenset[int]:
    """The process indices whose devices a plan's mesh uses."""
    return frozenset(d.process_index for d in plan.mesh.devices.flat)


class ProcessWeightPush:
    """Moves a parameter pytree and its policy version from one group of processes to another.

    Args:
      source: the training plan (its devices on the sending processes).
      target: the rollout plan (its devices on the receiving processes).

    Raises:
      MeshError: a process in both groups, different device counts, or a rollout mesh whose
        fsdp x expert x context x tp does not divide the training devices (named in one line).
    """

    def __init__(self, source: ShardingPlan, target: ShardingPlan):
        self.senders, self.receivers = plan_processes(source), plan_processes(target)
        shared = sorted(self.senders & self.receivers)
        if shared:
            raise MeshError(f"placement: process(es) {shared} hold devices of both train and rollout; across processes "
                            "give each role whole processes (device ranges on process boundaries)")
        n_source, n_target = source.mesh.devices.size, target.mesh.devices.size
        if n_source != n_target:
            raise MeshError(f"placement: train has {n_source} devices and rollout {n_target}; across processes the push "
                            "needs the same count in both (JAX's cross-host transfer moves same-layout shards)")
        self.sync = WeightSync(source, target)
        if dict(self.sync.staging_mesh.shape) != dict(target.mesh.shape):
            raise MeshError(f"placement: the rollout mesh {dict(target.mesh.shape)} cannot be laid out on the training "
                            f"devices as {dict(self.sync.staging_mesh.shape)}; give rollout mesh.data = its devices / "
                            "(fsdp x expert x context x tp)")
        self._version_target = NamedSharding(target.mesh, PartitionSpec())
        self._version_staging = NamedSharding(self.sync.staging_mesh, PartitionSpec())

    @property
    def role(self) -> str | None:
        """"send", "receive" or None (this process is in neither group)."""
        index = jax.process_index()
        return "send" if index in self.senders else "receive" if index in self.receivers else None

    def __call__(self, params: Any, policy_version: int | None = None) -> tuple[Any, int | None]:
        """Pushes the weights: call it on every process of both groups, in the same order.

        Args:
          params: on a sending process the parameters (on the training plan); on a receiving one
            the same tree abstractly (ShapeDtypeStruct leaves, e.g. from `nnx.eval_shape`).
          policy_version: the version of `params` (senders only).

        Returns:
          Senders: (None, policy_version). Receivers: (the parameters on the rollout mesh, their
          policy version).

        Raises:
          RuntimeError: called on a process in neither group.
          ValueError: a sender without a policy version.
        """
        role = self.role
        if role is None:
            raise RuntimeError(f"process {jax.process_index()} is in neither the training group {sorted(self.senders)} "
                               f"nor the rollout group {sorted(self.receivers)}; it must not call the push")
        target, staging = self.sync.shardings(params)
        if role == "send":
            if policy_version is None:
                raise ValueError("ProcessWeightPush: a sending process must give the policy_version of its params")
            staged = self.sync.stage_fn(params)(params)
            version = jax.make_array_from_callback((), self._version_staging, lambda _: np.int32(policy_version))
        else:
            staged = jax.tree.map(_placeholder, params, staging)
            version = _placeholder(jax.ShapeDtypeStruct((), np.int32), self._version_staging)
        moved, moved_version = jax.device_put((staged, version), (target, self._version_target))
        if role == "send":
            return None, int(policy_version)
        return moved, int(np.asarray(moved_version.addressable_shards[0].data))


def _placeholder(leaf: Any, sharding: Any) -> jax.Array:
    """A global array on `sharding` whose shards all live on other processes (this one holds none)."""
    if hasattr(sharding, "get_value"):  # param_shardings keeps nnx.Variable leaves
        sharding = sharding.get_value()
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, [], dtype=leaf.dtype)
