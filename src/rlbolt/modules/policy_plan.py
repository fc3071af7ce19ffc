"""What an `LMPolicyModule` tells the planner: `check_plan`'s refusal and `memory_plan`'s items.

    refuse_ungrouped(compute_advantages, name, num_generations)   PlanError when G = 1 zeroes every advantage
    held_memory(scorers, lora, model_config, ...)                  the models and KV cache beside the params
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rlbolt.batch import Batch
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.models.config import ModelConfig
from rlbolt.modules.lora_policy import LoraPolicy
from rlbolt.modules.scorers import LogpsScorer
from rlbolt.plan import PlanError


def refuse_ungrouped(compute_advantages: Callable[[Batch], Any], name: str, num_generations: int) -> None:
    """Refuses `num_generations=1` when an algorithm's advantages are group-relative.

    Found by what the algorithm computes, not by name: `compute_advantages` is probed with four
    groups of one sample and four different rewards. If every advantage comes back 0 (a baseline
    from the sample's own group: GRPO, Dr.GRPO, RLOO, GSPO, DAPO), no sample would ever get a
    gradient. Batch-level estimators (REINFORCE++, PPO's GAE) pass.

    Args:
      compute_advantages: the module's hook (`Batch -> [N] | [N, C] | {"advantages": ...}`).
      name: the module's class name, for the message.
      num_generations: `plan.num_generations`; above 1 nothing is probed.

    Raises:
      PlanError: every probed advantage is 0.
    """
    if num_generations > 1:
        return
    n, c = 4, 3
    probe = Batch(rewards=np.asarray([0.0, 1.0, 0.25, 0.5], np.float32), group_ids=np.arange(n),
                  completion_mask=np.ones((n, c), bool), old_logps=np.zeros((n, c), np.float32),
                  sampler_logps=np.zeros((n, c), np.float32), old_values=np.zeros((n, c), np.float32))
    try:
        out = compute_advantages(probe)
    except KeyError:  # a subclass reading columns the probe lacks: it cannot be judged this way
        return
    advantages = np.asarray(out["advantages"] if isinstance(out, Mapping) else out)
    if not np.any(advantages):
        raise PlanError(
            f"num_generations=1 with {name}: its advantage compares each sample with the other "
            "samples of the same prompt, so with one sample per prompt every advantage is 0 and nothing learns; "
            "use num_generations >= 2 (plan.num_generations)")


def held_memory(scorers: Mapping[str, LogpsScorer], lora: LoraPolicy | None, model_config: ModelConfig,
                rollout_rows: int, sequence_slots: int, sharding: ShardingPlan) -> dict[str, int]:
    """Bytes per device the module holds on the training devices besides the trained parameters.

    The frozen reference model (when beta > 0) or LoRA's frozen base, the teacher, and the
    sampler's KV cache for one rollout micro batch; a scorer on devices of its own is not on the
    training devices this plan describes.

    Args:
      scorers: the module's scorers by column stem ("ref", "teacher").
      lora: the LoraPolicy of a `model.lora` run, else None.
      model_config: the policy's ModelConfig (the KV cache's shape).
      rollout_rows: `plan.rollout_micro_batch_size`.
      sequence_slots: the KV cache's slots per row (longest prompt + completion width - 1).
      sharding: the training role's ShardingPlan.

    Returns:
      `{item: bytes per device}`.
    """
    from rlbolt.distributed import kv_cache_bytes, per_device_bytes

    held = {name: s for name, s in scorers.items() if s.on_train_devices and s.params is not None}
    out = {"reference": per_device_bytes(held["ref"].params)} if "ref" in held else {}
    if lora is not None:
        out["frozen base"] = per_device_bytes(lora.base)
    if "teacher" in held:
        out["teacher"] = per_device_bytes(held["teacher"].params)
    rows = 1 << max(0, (rollout_rows - 1).bit_length())  # the sampler pads a call to a power of two
    # An upper bound: with the prompt shared the prompt slots are held once per group.
    out["kv cache"] = kv_cache_bytes(model_config, rows, sequence_slots, sharding)
    return out
