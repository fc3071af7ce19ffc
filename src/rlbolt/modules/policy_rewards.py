"""The host-side rewards and advantage terms of `LMPolicyModule`'s `on_reward` / `on_advantage`.

    batch_rewards(runner, batch, share, algo, max_new_tokens, log)   the runner's scores + DAPO's overlong penalty
    distill_advantages(batch, task_advantages, algo, log)            on-policy distillation's per-token advantages

Each takes what it needs as arguments; metrics go through the `log` it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rlbolt.algorithms import overlong_penalty, reverse_kl_advantages
from rlbolt.batch import Batch, row_fields
from rlbolt.config.sections import AlgorithmSection
from rlbolt.distributed.sharding import DataShare
from rlbolt.modules.prompts import rows_of
from rlbolt.modules.rewarding import score_shared
from rlbolt.rewards import RewardRunner


def batch_rewards(runner: RewardRunner, batch: Batch, share: DataShare | None, algo: AlgorithmSection,
                  max_new_tokens: int, log: Callable[[str, float], None]) -> np.ndarray:
    """Scores each completion with the reward runner (failure-isolated) and adds DAPO's overlong
    penalty when `algorithm.overlong_cache_length` > 0.

    Args:
      runner: the failure-isolated RewardRunner.
      batch: the rolled-out batch (`completion_text`, `completion_mask` and the prompt rows' fields).
      share: this process's DataShare (it scores its rows), or None (one process).
      algo: the algorithm section (`overlong_cache_length`).
      max_new_tokens: `rollout.max_new_tokens` (where the overlong penalty ends).
      log: the module's `log(name, value)`.

    Returns:
      [N] float32 rewards.
    """
    samples = rows_of(batch, row_fields(batch))
    rewards, metrics = score_shared(runner, list(batch["completion_text"]), samples, share)
    for name, value in metrics.items():
        if name not in ("reward/mean", "reward/std"):  # the producer reports those after filtering
            log(name, value)
    if algo.overlong_cache_length > 0:
        lengths = np.asarray(batch["completion_mask"]).sum(axis=1)
        penalty = np.asarray(overlong_penalty(lengths, max_new_tokens, algo.overlong_cache_length))
        log("reward/overlong_penalty", float(penalty.mean()))
        rewards = rewards + penalty
    return rewards


def distill_advantages(batch: Batch, task_advantages: Any, algo: AlgorithmSection,
                       log: Callable[[str, float], None]) -> Any:
    """On-policy distillation: the teacher's per-token reverse KL as the advantage, plus the task's
    advantages weighted by `algorithm.distill_task_coef` when it is > 0 (`distill/reverse_kl` logged).

    Args:
      batch: the batch holding `old_logps`, `teacher_logps` and `completion_mask`.
      task_advantages: the algorithm's own advantages ([N] or [N, C]).
      algo: the algorithm section (`distill_kl_coef`, `distill_task_coef`).
      log: the module's `log(name, value)`.

    Returns:
      [N, C] advantages.
    """
    mask = np.asarray(batch["completion_mask"], bool)
    task = task_advantages if algo.distill_task_coef > 0 else None
    advantages, reverse_kl = reverse_kl_advantages(
        batch["old_logps"], batch["teacher_logps"], mask, kl_coef=algo.distill_kl_coef, task_advantages=task,
        task_coef=algo.distill_task_coef)
    log("distill/reverse_kl", float(np.asarray(reverse_kl)[mask].mean()) if mask.any() else 0.0)
    return advantages
