"""Reward terms a config can name (`reward.weights: {answer: 1.0, format: 0.1}`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rlbolt.distributed.sharding import DataShare
from rlbolt.rewards import RewardRunner, WeightedReward, gsm8k_reward
from rlbolt.rewards.task_reward import reasoning_gym_reward
from rlbolt.rewards.terms import REWARD_TERMS


def build_reward(weights: Mapping[str, float], *, answer_field: str = "answer") -> WeightedReward:
    """A `WeightedReward` from `{term: weight}`; terms with weight 0 are left out.

    Args:
      weights: term -> weight, terms registered in `rlbolt.rewards.terms.REWARD_TERMS`: "answer"
        (GSM8K final answer, 0/1), "format" (think/answer tags, 0..1), "digits"
        (`digit_fraction_reward`), "task" (a reasoning-gym row's own scorer on the extracted
        answer: `reasoning_gym_reward`), "env" (the episode's environment rewards), a user's.
      answer_field: the prompt-row field holding the gold answer.

    Returns:
      The weighted reward.
    """
    unknown = [t for t in weights if t not in REWARD_TERMS]
    if unknown:
        raise ValueError(f"reward.weights has unknown term(s) {unknown}; known terms: {list(REWARD_TERMS.names())}")
    terms = [(name, REWARD_TERMS[name](answer_field), float(w)) for name, w in weights.items() if w != 0]
    if not terms:
        raise ValueError(f"reward.weights={dict(weights)} gives every term weight 0; give at least one a weight")
    return WeightedReward(terms)


def answer_score(completion: str, row: Mapping[str, Any], answer_field: str) -> float:
    """1.0 when the completion's final answer matches the row's gold answer; 0.0 otherwise,
    including when the row's answer cannot be parsed (validation must not crash on one bad row).
    A reasoning-gym row (it names its `task`) is graded by its task's scorer, all or nothing."""
    if "task" in row and "task_options" in row:
        return float(reasoning_gym_reward(completion, row, binary=True))
    try:
        return gsm8k_reward(completion, row, answer_key=answer_field)
    except (KeyError, ValueError):
        return 0.0


def score_shared(runner: RewardRunner, texts: list[str], samples: list[Mapping[str, Any]],
                 share: DataShare | None = None) -> tuple[np.ndarray, dict]:
    """Rewards of a global batch, each process scoring only its data share's rows.

    On several processes every one holds the whole gathered batch (its share's rows in share
    order); scoring is the expensive part (a sandbox runs code), so each scores its rows and the
    scores are gathered. The metrics are recomputed from the gathered per-term scores, so they
    equal the one-process run's. The runner's broken-reward stop (`RewardFailureError`) counts
    per share and is raised on every process when any share raises it.

    Args:
      runner: the RewardRunner.
      texts: the N completions.
      samples: the N prompt rows.
      share: the `rlbolt.distributed.DataShare` (None: one process).

    Returns:
      ([N] float32 rewards, the runner's metrics over all N).
    """
    if share is None or share.size == 1:
        result = runner.score(texts, samples)
        return np.asarray(result.rewards, np.float32), result.metrics
    from rlbolt.distributed import gather_shares

    from rlbolt.rewards import RewardFailureError

    lo, hi = share.range(len(texts))
    try:
        mine = runner.score(texts[lo:hi], samples[lo:hi])
        local = (np.asarray(mine.rewards, np.float32), mine.per_fn, len(mine.errors),
                 float(mine.metrics["reward/timeouts"]), None)
    except RewardFailureError as error:  # told to the others: every process stops, none waits
        local = (None, None, 0, 0.0, str(error))
    parts = gather_shares(local, share.rank, share.size, getattr(share, "processes", None))  # its group only
    failed = [p[4] for p in parts if p[4] is not None]
    if failed:  # a share whose every sample failed for max_failed_batches batches stops the run
        raise RewardFailureError(failed[0])
    rewards = np.concatenate([p[0] for p in parts])
    as64 = rewards.astype(np.float64)
    metrics = {"reward/mean": float(as64.mean()), "reward/std": float(as64.std()),
               "reward/failures": float(sum(p[2] for p in parts) - sum(p[3] for p in parts)),
               "reward/timeouts": float(sum(p[3] for p in parts))}
    for name in parts[0][1]:
        values = np.concatenate([p[1][name] for p in parts])
        scored = values[~np.isnan(values)]
        if scored.size:
            metrics[f"reward/{name}/mean"] = float(scored.astype(np.float64).mean())
    return rewards, metrics
