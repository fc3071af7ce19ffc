"""Several devices and hosts: meshes, sharding rules, jax.distributed start-up, cross-process agreement.

    MeshSpec(data, fsdp, tp, expert, context).build() -> Mesh    mesh.py
    ShardingPlan(mesh, rules): params / batches -> NamedShardings sharding.py
    initialize(...): jax.distributed from config or environment  runtime.py
    any_process(flag), gather_objects(obj), ...                  agree.py
    plan_memory(...) -> MemoryPlan (per-device bytes, refusal)   memory.py
"""

from rlbolt.distributed.agree import any_process, gather_objects, gather_shares, max_over_processes, sum_over_processes
from rlbolt.distributed.memory import MemoryPlan, MemoryPlanError, kv_cache_bytes, plan_memory
from rlbolt.distributed.mesh import AXES, BATCH_AXES, MeshError, MeshSpec, as_mesh, batch_shards, describe
from rlbolt.distributed.runtime import initialize, is_initialized, is_main_process
from rlbolt.distributed.sharding import (DEFAULT_RULES, DataShare, ShardingPlan, gather_to_host, host_tree, host_value,
                                        per_device_bytes)

__all__ = [
    "AXES", "BATCH_AXES", "DEFAULT_RULES", "DataShare", "MemoryPlan", "MemoryPlanError", "MeshError", "MeshSpec",
    "ShardingPlan", "any_process", "as_mesh", "batch_shards", "describe", "gather_objects", "gather_shares",
    "gather_to_host",
    "host_tree", "host_value", "initialize", "is_initialized", "is_main_process", "kv_cache_bytes",
    "max_over_processes", "per_device_bytes", "plan_memory", "sum_over_processes",
]
