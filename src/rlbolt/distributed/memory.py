"""The memory plan: what one device will hold, computed before anything compiles.

    params            the trainable parameters, as sharded (read from the live arrays)
    gradients         the same size as the params, alive during each update (in the masters'
                      dtype, float32, when there are master weights)
    master weights    float32 copies of bfloat16 params (`rlbolt.master_weights`), if any
    optimizer state   as sharded (Adam: two params-sized moments, float32 beside masters)
    + the module's own items (`RLModule.memory_plan`): a frozen reference model, the KV cache

Activations and compiler temporaries come on top and are not estimated here; `rlbolt plan`
(`rlbolt.planning`) compiles the step's executables and reports them from the compiler's buffer
assignment, where the planner can run. When the backend reports
how much memory a device has (GPU, TPU: `bytes_limit`), a plan whose items alone exceed it is
refused with the numbers and what would shrink them; where it does not (CPU), the plan is logged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from rlbolt.distributed.mesh import describe
from rlbolt.distributed.sharding import ShardingPlan, per_device_bytes
from rlbolt.master_weights import MasterWeightsState

log = logging.getLogger(__name__)


class MemoryPlanError(RuntimeError):
    """The planned per-device bytes exceed the device's memory."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of each item, for one mesh.

    Attributes:
      items: {name: bytes one device holds}, in display order.
      device_bytes: the device's memory when the backend reports it (None otherwise).
      mesh: the mesh, in words.
      axes: the mesh's axis sizes ({"data": .., "fsdp": .., "expert": .., "tp": ..}).
    """

    items: dict[str, int]
    device_bytes: int | None
    mesh: str
    axes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def text(self) -> str:
        """One line: every item, the total, and the device's memory when known."""
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.items.items())
        limit = f" of {_fmt(self.device_bytes)}" if self.device_bytes else ", device memory not reported"
        return f"memory plan per device, mesh {self.mesh}: {parts}; total {_fmt(self.total)}{limit}; activations come on top (rlbolt plan compiles the step and counts them)"

    def check(self) -> None:
        """Raises MemoryPlanError when the items alone exceed the device's memory."""
        if self.device_bytes is None or self.total <= self.device_bytes:
            return
        raise MemoryPlanError(f"{self.text()}: this plan cannot fit. {_suggest(self)}")


def plan_memory(sharding: ShardingPlan, params: Any, opt_state: Any, extra: dict[str, int] | None = None,
                device_bytes: int | None = None) -> MemoryPlan:
    """The MemoryPlan of a placed training state.

    Args:
      sharding: the training ShardingPlan.
      params: the placed parameters (arrays or ShapeDtypeStructs with shardings).
      opt_state: the placed optimizer state.
      extra: more items in bytes per device (`RLModule.memory_plan`).
      device_bytes: the per-device budget; None asks the backend (`device_memory_bytes`).
    """
    param_bytes = per_device_bytes(params)
    if isinstance(opt_state, MasterWeightsState):  # gradients are accumulated in the masters' dtype
        master_bytes = per_device_bytes(opt_state.masters)
        items = {"params": param_bytes, "gradients": master_bytes, "master weights": master_bytes,
                 "optimizer state": per_device_bytes(opt_state.inner)}
    else:
        items = {"params": param_bytes, "gradients": param_bytes, "optimizer state": per_device_bytes(opt_state)}
    items.update(extra or {})
    budget = device_bytes if device_bytes is not None else device_memory_bytes(sharding)
    return MemoryPlan(items, budget, describe(sharding.mesh), dict(sharding.mesh.shape))


def device_memory_bytes(sharding: ShardingPlan) -> int | None:
    """The smallest memory over this process's mesh devices: the backend's `bytes_limit`, or for a
    device without one (a described TPU slice's abstract chips) the per-kind table of
    `rlbolt.distributed.topology` (None: neither knows, e.g. a CPU)."""
    from rlbolt.distributed.topology import device_hbm_bytes

    devices = list(sharding.mesh.devices.flat)
    mine = [d for d in devices if d.process_index == jax.process_index()] or devices[:1]
    limits = [device_hbm_bytes(device)[0] for device in mine]
    return None if not limits or None in limits else min(limits)


def kv_cache_bytes(config: Any, batch: int, max_len: int, sharding: ShardingPlan) -> int:
    """Per-device bytes of the sampler's KV cache for `batch` rows of `max_len` slots.

    Rows split over the batch shards; key/value heads over `tp` when they divide it (else every
    tp device holds all of them).
    """
    rows = -(-batch // sharding.batch_shards)
    tp = sharding.mesh.shape["tp"]
    heads = config.num_kv_heads // tp if config.num_kv_heads % tp == 0 else config.num_kv_heads
    itemsize = jax.numpy.dtype(config.dtype).itemsize
    mask = rows * max_len  # bool slots
    return config.num_layers * 2 * rows * heads * config.head_dim * max_len * itemsize + mask


def _suggest(plan: MemoryPlan) -> str:
    hints = []
    if plan.axes.get("data", 1) > 1:
        hints.append(f"move the data={plan.axes['data']} replicas onto mesh.fsdp (each replica holds a full "
                     "copy; fsdp shards params, gradients and optimizer state)")
    hints.append("use more devices (a larger mesh.fsdp or mesh.tp divides every parameter-sized item)")
    if plan.items.get("kv cache", 0) > plan.total // 4:
        hints.append("lower plan.rollout_micro_batch_size or rollout.max_new_tokens (KV cache)")
    hints.append("callbacks.offload=true keeps the optimizer state and the reference model in host memory")
    if "master weights" in plan.items:
        hints.append("model.master_weights=none drops the float32 masters and keeps the moments in bfloat16 "
                     "(updates below a bfloat16 ulp are then lost)")
    else:
        hints.append("model.param_dtype=bfloat16 halves every parameter-sized item")
    return "Try: " + "; ".join(hints) + "."


def _fmt(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
