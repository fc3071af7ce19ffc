"""`LMPolicyModule.validation_step`'s metrics: greedy accuracy and pass@k, or with an environment
the mean reward of greedy episodes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.batch import Batch, row_fields
from rlbolt.modules.policy_rollout import PolicyRollout
from rlbolt.modules.prompts import PromptEncoder, rows_of
from rlbolt.modules.rewarding import answer_score


def validation_metrics(rollout: PolicyRollout, encoder: PromptEncoder, params: Any, batch: Batch, *,
                       answer_field: str, k: int, temperature: float) -> dict[str, float]:
    """Greedy accuracy and, when `k` > 1, pass@k over k samples per prompt at `temperature`.

    Args:
      rollout: the module's PolicyRollout (an environment's episodes when it has an env factory).
      encoder: the prompt encoder (rows -> token ids).
      params: the parameters the rollout samples with.
      batch: the validation rows with their `sample_keys`.
      answer_field: the prompt-row field holding the gold answer (`data.answer_field`).
      k: samples per prompt for pass@k (1: greedy accuracy only).
      temperature: the sampling temperature of the k samples (`rollout.val_temperature`).

    Returns:
      `{"accuracy": ..., "pass@k": ...}`, or `{"env_reward": ...}` with an environment.
    """
    rows = rows_of(batch, [f for f in row_fields(batch) if f != "prompt_index"])
    keys = np.asarray(batch["sample_keys"], np.uint32)
    if rollout.env_factory is not None:  # greedy episodes: the mean environment reward
        episodes = rollout.episodes(params, rows, keys, None, 0.0, log=False)
        return {"env_reward": float(np.mean(episodes["env_reward"]))}
    ids = encoder.encode_rows(rows)
    greedy = rollout.generate(params, ids, keys, 0.0).output
    texts = rollout.decode(greedy.completion_ids, greedy.completion_mask)
    metrics = {"accuracy": float(np.mean([answer_score(t, r, answer_field) for t, r in zip(texts, rows)]))}
    if k > 1:
        many_keys = np.asarray(jax.vmap(lambda key: jax.random.split(key, k))(jnp.asarray(keys)), np.uint32)
        out = rollout.generate(params, [i for i in ids for _ in range(k)], many_keys.reshape(-1, 2), temperature).output
        texts = rollout.decode(out.completion_ids, out.completion_mask)
        scores = np.array([answer_score(t, rows[j // k], answer_field) for j, t in enumerate(texts)])
        metrics[f"pass@{k}"] = float(scores.reshape(-1, k).max(axis=1).mean())
    return metrics
