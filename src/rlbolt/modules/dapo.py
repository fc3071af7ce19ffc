"""DAPO (arXiv 2503.14476): clip-higher, dynamic sampling, token-level loss, overlong shaping.

- Clip-higher (Eq. 10): clip_low 0.2, clip_high 0.28 (config defaults for "dapo").
- Dynamic sampling (Eq. 11): groups whose rewards are all equal have zero advantage and no
  gradient; `filter_groups` drops them, and the producer draws more prompts, up to
  `plan.max_refill_rounds` rounds, until the global batch is full (it logs
  `refill/dropped_samples`; this module logs `dynamic_sampling/dropped_groups` per round).
- Token-level policy gradient loss (Eq. 12): `token-mean` aggregation.
- Soft overlong punishment (Eq. 13): added to the reward in `compute_rewards` when
  `algorithm.overlong_cache_length` > 0 (default: max_new_tokens // 4).
- DAPO drops the KL term (beta = 0 by default); setting beta > 0 adds it back.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rlbolt.algorithms import group_reward_spread
from rlbolt.batch import Batch
from rlbolt.modules.policy import LMPolicyModule


class DAPO(LMPolicyModule):
    """GRPO with DAPO's four changes (see the module docstring)."""

    algorithm_name = "dapo"
    algorithm_defaults = {"clip_high": 0.28, "loss_aggregation": "token-mean", "dynamic_sampling": True,
                          "overlong_cache_length": lambda cfg: cfg.rollout.max_new_tokens // 4}

    def filter_groups(self, batch: Batch) -> Batch:
        """Keeps the groups whose rewards differ (max - min > 0); logs how many were dropped."""
        if not self.algo.dynamic_sampling:
            return batch
        spread = np.asarray(group_reward_spread(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"])).range)
        keep = spread > 0
        groups = np.asarray(batch["group_ids"])
        self.log("dynamic_sampling/dropped_groups", float(len(np.unique(groups[~keep]))))
        self.log("dynamic_sampling/kept_fraction", float(keep.mean()))
        return batch.select(keep)
