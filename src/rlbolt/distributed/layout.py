"""The Trainer's side of the mesh: building the plan, checking batch sizes against it, placing the
training state, and turning a host mini batch into sharded micro batches.

    sharding = training_plan(mesh)                 MeshSpec | dict | Mesh | ShardingPlan | None
    check_batch_plan(plan, sharding)               every size splits over the batch shards and processes
    params = sharding.place(module.init_params())  no copy when the module built them in place
    opt_state = init_optimizer(tx, params, sharding)   born sharded, never whole on one device
    micro = micro_batches(sharding, host_mini, A)  [A, M/A, ...], sample axis over data x fsdp
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import optax

from rlbolt.batch import Batch
from rlbolt.distributed.memory import MemoryPlan, plan_memory
from rlbolt.distributed.mesh import MeshError, MeshSpec, as_mesh, describe, mesh_processes
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.update import split_micro_batches

log = logging.getLogger(__name__)


def training_plan(mesh: Any, devices: Any = None) -> ShardingPlan:
    """The ShardingPlan for a Trainer's `mesh` argument.

    Args:
      mesh: a ShardingPlan (used as is), a `jax.sharding.Mesh`, a MeshSpec, a `{data, fsdp, tp}`
        dict, or None (every visible device on fsdp).
      devices: the devices a MeshSpec or dict is laid over (None: every visible device; a described
        slice's abstract devices when planning, `rlbolt.distributed.topology`).
    """
    if isinstance(mesh, ShardingPlan):
        return mesh
    if not (mesh is None or isinstance(mesh, (MeshSpec, Mapping, jax.sharding.Mesh))):
        raise TypeError(f"Trainer(mesh={mesh!r}): pass a MeshSpec, a {{data, fsdp, tp}} dict, a jax.sharding.Mesh, "
                        "a ShardingPlan or None")
    plan = ShardingPlan(as_mesh(mesh, devices))
    log.info("mesh: %s", describe(plan.mesh))
    return plan


def check_placed_role(plan: Any, role: ShardingPlan, name: str) -> None:
    """A role on devices of its own (`placement.<name>`: the reference, a teacher) runs its
    forward on logps micro batches, which must split over its mesh's batch shards.

    Raises:
      MeshError: naming plan.logps_micro_batch_size, the role's mesh and what would work.
    """
    rows, shards = plan.logps_micro_batch_size, role.batch_shards
    if rows % shards:
        raise MeshError(f"plan.logps_micro_batch_size={rows} cannot be split over the {name} mesh's {shards} batch "
                        f"shards ({describe(role.mesh)}); use a multiple of {shards}, or move placement.{name}'s "
                        "devices to mesh.tp")


def check_batch_plan(plan: Any, sharding: ShardingPlan, mode: str = "sync",
                     reference: ShardingPlan | None = None, across_groups: bool = False) -> None:
    """Every batch the Trainer places must split evenly over the batch shards and data shares.

    Args:
      plan: the BatchPlan.
      sharding: the training plan.
      mode: "sync" or "async".
      reference: the reference role's plan when it has devices of its own (its forward takes
        logps micro batches), else None or `sharding`.
      across_groups: train and rollout run on process groups of their own: the training group's
        producer feeds a step only after the previous update (`ProcessGroups.attach`), so async
        mode runs there.

    Raises:
      MeshError: naming the field, its value and the sizes that would work (or the mode).
    """
    sharding.check_divides("plan.train_micro_batch_size", plan.train_micro_batch_size)
    if reference is not None and reference is not sharding:
        check_placed_role(plan, reference, "reference")
    processes = mesh_processes(sharding.mesh)  # the mesh's, not this host's
    if mode == "async" and processes > 1 and not across_groups:
        # The producer thread's collectives (rollout) would overlap the main thread's (update)
        # in a different order on each process, and collectives must be issued in one order.
        raise MeshError(f"mode='async' is not supported on a training mesh of {processes} processes that also roll "
                        "out; use mode='sync', or give rollout processes of their own (trainer.placement across "
                        "processes), or one process on many devices")
    size = sharding.share.size
    if size == 1:
        return
    for name in ("prompts_per_step", "rollout_micro_batch_size", "logps_micro_batch_size", "service_batch_size"):
        value = getattr(plan, name)
        if value % size:
            raise MeshError(f"plan.{name}={value} cannot be split over the {size} processes that produce data "
                            f"(mesh {describe(sharding.mesh)}); use a multiple of {size}")
    sharding.check_divides("plan.logps_micro_batch_size", plan.logps_micro_batch_size)


def init_optimizer(optimizer: optax.GradientTransformation, params: Any, sharding: ShardingPlan) -> Any:
    """`optimizer.init(params)` computed directly into its shardings (moments follow their params);
    for abstract params (ShapeDtypeStructs: `rlbolt.planning`) the abstract state with those shardings."""
    abstract = jax.eval_shape(optimizer.init, params)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return sharding.place(abstract, sharding.param_shardings(abstract))
    return jax.jit(optimizer.init, out_shardings=sharding.param_shardings(abstract))(params)


def micro_batches(sharding: ShardingPlan, host_mini: Batch, grad_accum_steps: int) -> Batch:
    """A host mini batch (held whole by every process) -> [A, M/A, ...] global arrays."""
    return sharding.put_full(split_micro_batches(host_mini, grad_accum_steps), sample_dim=1)


def memory_plan(module_bytes: dict[str, int], params: Any, opt_state: Any, sharding: ShardingPlan, *,
                device_bytes: int | None = None) -> MemoryPlan:
    """Logs the per-device memory plan and refuses one that cannot fit (see `rlbolt.distributed.memory`).

    Args:
      module_bytes: what the module keeps besides params and optimizer state (`RLModule.memory_plan`).
      params: the trainable parameters, placed.
      opt_state: the optimizer state, placed.
      sharding: the training ShardingPlan.
      device_bytes: the per-device budget (None: what the backend reports).
    """
    plan = plan_memory(sharding, params, opt_state, module_bytes, device_bytes=device_bytes)
    log.info("%s", plan.text())
    plan.check()
    return plan


def validation_rows(start: int, stop: int, share: Any) -> tuple[list[int], int]:
    """This data share's rows of validation rows [start, stop), and their weight: near-equal
    parts, and one filler row of weight 0 for a share left empty (every process must call the
    sampler, a collective)."""
    n = stop - start
    lo, hi = start + share.rank * n // share.size, start + (share.rank + 1) * n // share.size
    return (list(range(lo, hi)), hi - lo) if hi > lo else ([start], 0)
