"""The critic-free group-relative family: GRPO, Dr.GRPO, RLOO and GSPO.

Each is `LMPolicyModule` with one or two pieces swapped; the config's algorithm defaults
(each class's `algorithm_defaults`) pick each paper's clip range and loss aggregation. Another
`algorithm.policy_loss` brings its own paper's settings, which win over these
(each objective's `register_objective(..., defaults=, aggregation=)` in `rlbolt.algorithms.objectives`:
GMPO trains seq-mean-token-mean, CISPO token-mean).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rlbolt.algorithms import drgrpo_advantages, kl_in_reward, rloo_advantages
from rlbolt.batch import Batch
from rlbolt.modules.policy import LMPolicyModule


class GRPO(LMPolicyModule):
    """GRPO (DeepSeekMath, arXiv 2402.03300): group z-scored rewards, PPO-clip, k3 KL in the loss,
    `seq-mean-token-mean` aggregation (Eq. 3)."""

    algorithm_name = "grpo"
    algorithm_defaults = {"loss_aggregation": "seq-mean-token-mean"}


class DrGRPO(LMPolicyModule):
    """Dr.GRPO (arXiv 2503.20783): group mean-centred rewards without std scaling, and the
    `seq-mean-token-sum-norm` aggregation (divide by the generation budget, not the length)."""

    algorithm_name = "drgrpo"
    algorithm_defaults = {"loss_aggregation": "seq-mean-token-sum-norm"}

    def compute_advantages(self, batch: Batch):
        """Dr.GRPO: each reward minus its group's mean, not divided by the group's std ([N])."""
        return drgrpo_advantages(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]))


class RLOO(LMPolicyModule):
    """RLOO (Ahmadian et al., arXiv 2402.14740): leave-one-out baselines over the group; the KL
    to the reference (when beta > 0) is folded into the sequence reward, r - beta * sum_t KL_t,
    and the loss is sequence-level (`seq-mean-token-sum`: A_i * log pi(y_i))."""

    algorithm_name = "rloo"
    algorithm_defaults = {"loss_aggregation": "seq-mean-token-sum"}
    kl_in_loss = False

    def compute_rewards(self, batch: Batch) -> np.ndarray:
        """RLOO: the reward runner's scores minus beta * the sequence's summed KL to the reference
        (when beta > 0), so the KL enters through the reward, not the loss. Returns [N] float32."""
        rewards = super().compute_rewards(batch)
        if self.algo.beta > 0 and "ref_logps" in batch:
            rewards = np.asarray(kl_in_reward(rewards, batch["old_logps"], batch["ref_logps"], batch["completion_mask"],
                                              self.algo.beta, self.algo.kl_kind, per_token=False,
                                              clamp=self.algo.kl_clamp))
        return rewards

    def compute_advantages(self, batch: Batch):
        """RLOO: each reward minus the mean reward of the other samples of its group ([N])."""
        return rloo_advantages(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]))


class GSPO(LMPolicyModule):
    """GSPO (arXiv 2507.18071): the clipped surrogate on the length-normalised sequence ratio
    (GSPO-token form), tiny clip ranges 3e-4 / 4e-4, group z-scored advantages."""

    algorithm_name = "gspo"
    algorithm_defaults = {"clip_low": 3e-4, "clip_high": 4e-4, "loss_aggregation": "seq-mean-token-mean",
                          "policy_loss": "gspo"}
