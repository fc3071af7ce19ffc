"""The old logps `LMPolicyModule.compute_logps` adds, and the rollout correction's columns.

    needs_old_forward(num_iterations, algo, has_teacher, measures_routing)   whether they take a forward
    policy_old_logps(policy, lm_params, sharding, batch, group, ...)   the policy's forward over the batch,
                                                                       replaying or measuring MoE routing
    correction_columns(old, batch, algo, log)                          importance_weights, keep_mask

Each takes what it needs as arguments; metrics go through the `log` it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlbolt.algorithms import rollout_correction
from rlbolt.batch import Batch
from rlbolt.config.sections import AlgorithmSection
from rlbolt.distributed.sharding import ShardingPlan, host_value
from rlbolt.modules.moe_routing import ROUTING_COLUMNS
from rlbolt.modules.policy_model import PolicyModel, local_rows, rows_on_mesh


def needs_old_forward(num_iterations: int, algo: AlgorithmSection, has_teacher: bool, measures_routing: bool) -> bool:
    """Whether old logps need the trainer's forward rather than the sampler's logps.

    Yes with several updates per batch, a rollout correction, a teacher (its logps come from the
    trainer's forward, so the student's must too: a teacher equal to the student gives a reverse KL
    of exactly 0), or recorded routing without replay (the forward recomputes it and logs
    moe/routing_mismatch).

    Args:
      num_iterations: `plan.num_iterations` (updates per batch).
      algo: the algorithm section (`rollout_correction`).
      has_teacher: whether a distillation teacher scores the batch.
      measures_routing: `rollout.record_routing` without `algorithm.router_replay`.
    """
    return num_iterations > 1 or algo.rollout_correction != "none" or has_teacher or measures_routing


def policy_old_logps(policy: PolicyModel, lm_params: Any, sharding: ShardingPlan | None, batch: Batch, group: int, *,
                     replay: bool, measure: bool, log: Callable[[str, float], None]) -> np.ndarray:
    """The policy's logps of `batch` ([N, C] float32 host rows).

    Args:
      policy: the PolicyModel whose jitted logps forward runs.
      lm_params: the language model's full parameters (LoRA: joined with the base).
      sharding: the training role's ShardingPlan, or None (one device).
      batch: the rolled-out batch (with the routing columns when routing was recorded).
      group: the group size each prompt is shared over (1: unshared).
      replay: replay the recorded routing (`algorithm.router_replay`).
      measure: recorded routing without replay: recompute it and log `moe/routing_mismatch`.
      log: the module's `log(name, value)`.
    """
    inputs = rows_on_mesh(sharding, batch)
    routing = rows_on_mesh(sharding, batch, ROUTING_COLUMNS) if measure or replay else None
    if measure:
        logps, mismatched, total = policy.logps_and_mismatch(lm_params, *inputs, *routing, group_size=group)
        log("moe/routing_mismatch", float(host_value(mismatched)) / max(float(host_value(total)), 1.0))
        return local_rows(sharding, logps)
    return local_rows(sharding, policy.logps(lm_params, *inputs, group_size=group, routing=routing))


def correction_columns(old: np.ndarray, batch: Batch, algo: AlgorithmSection,
                       log: Callable[[str, float], None]) -> dict[str, np.ndarray]:
    """`importance_weights` and `keep_mask` of the engine's logps against `old` (metrics logged).

    Args:
      old: the trainer's old logps [N, C].
      batch: the batch holding `sampler_logps` and `completion_mask`.
      algo: the algorithm section (`rollout_correction`, `_level`, `_cap`).
      log: the module's `log(name, value)`.
    """
    weights, keep, metrics = rollout_correction(
        jnp.asarray(old), jnp.asarray(batch["sampler_logps"]), jnp.asarray(batch["completion_mask"]),
        mode=algo.rollout_correction, level=algo.rollout_correction_level, cap=algo.rollout_correction_cap)
    for name, value in metrics.items():
        log(name, float(value))
    # The objectives see the keep-mask (a dropped token is out of every sequence ratio and
    # covariance they pool: algorithms/objectives.py); the aggregation keeps the completion mask, so a
    # dropped token keeps its place in the normaliser with weight 0 and the loss's scale does
    # not depend on how many tokens were dropped (verl instead removes them from the mask).
    return {"importance_weights": np.asarray(jnp.where(keep, weights, 0.0), np.float32),
            "keep_mask": np.asarray(keep, bool)}
