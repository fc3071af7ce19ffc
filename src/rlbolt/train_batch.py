"""One global batch's updates: `plan.num_iterations` passes of one jitted update per mini batch
(`Trainer` calls it between `on_update_start` and `on_update_end`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rlbolt.batch import Batch
from rlbolt.distributed import host_tree, layout
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.packing import packing_spec, with_pack_columns
from rlbolt.plan import BatchPlan


def run_updates(update: Callable, batch: Batch, plan: BatchPlan, sharding: ShardingPlan, params: Any, opt_state: Any,
                version: int) -> tuple[Any, Any, int, dict[str, float], np.ndarray]:
    """`plan.num_iterations` passes of one `update` per mini batch over a global batch.

    Args:
      update: the jitted `(params, opt_state, micro batches) -> (params, opt_state, metrics)`.
      batch: the global batch on the host (every process holds all of it).
      plan: the BatchPlan (mini batch size, gradient accumulation, iterations, packing).
      sharding: the train role's ShardingPlan (places each mini batch's micro batches).
      params: the trainable parameters before the first update.
      opt_state: the optimizer state before the first update.
      version: the policy version of `params`; each update adds one.

    Returns:
      (params, opt_state, version after the updates, the update metrics' means, each trained
      sample's staleness: the policy version it trained at minus the one that sampled it).
    """
    versions = np.asarray(batch["policy_version"])
    spec = packing_spec(plan, sharding)
    if spec is not None:  # plan.packing: each train micro batch's samples placed in packed rows (rlbolt.packing)
        batch = with_pack_columns(batch, plan.train_micro_batch_size, spec)
    mini_size, accum = plan.mini_batch_size, plan.grad_accum_steps
    minis = [layout.micro_batches(sharding, batch.slice(s, s + mini_size), accum)
             for s in range(0, batch.num_samples, mini_size)]
    device_metrics, staleness = [], []
    for _ in range(plan.num_iterations):
        for i, mini in enumerate(minis):
            staleness.append(version - versions[i * mini_size:(i + 1) * mini_size])
            params, opt_state, m = update(params, opt_state, mini)
            device_metrics.append(m)
            version += 1
    host = host_tree(device_metrics)  # the one host sync of the step: all update metrics at once
    metrics = {k: float(np.mean([m[k] for m in host])) for k in host[0]}
    return params, opt_state, version, metrics, np.concatenate(staleness)
