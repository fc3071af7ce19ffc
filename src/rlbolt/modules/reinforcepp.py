"""REINFORCE++ (arXiv 2501.03262): critic-free, token-level KL-shaped returns, global whitening.

The token reward is the sequence reward on the last token minus beta * KL_t (Eq. 1, the KL
estimator is `algorithm.kl_kind` between the old and reference logps), the advantage is the
return-to-go with discount `algorithm.gamma`, whitened over every valid token of the global
batch (Eq. 3). The KL lives in the reward, so the loss has no KL term; PPO-clip on top.
"""

from __future__ import annotations

import jax.numpy as jnp

from rlbolt.algorithms import kl_penalty, reinforcepp_advantages
from rlbolt.batch import Batch
from rlbolt.modules.policy import LMPolicyModule


class ReinforcePP(LMPolicyModule):
    """REINFORCE++ with its global-batch advantage normalisation ([N, C] advantages)."""

    algorithm_name = "reinforcepp"
    algorithm_defaults = {"loss_aggregation": "token-mean"}
    kl_in_loss = False

    def compute_advantages(self, batch: Batch):
        """REINFORCE++: returns-to-go of the KL-shaped token rewards (KL from old vs reference logps
        when beta > 0), whitened over every valid token of the global batch ([N, C])."""
        mask = jnp.asarray(batch["completion_mask"])
        kl = None
        if self.algo.beta > 0 and "ref_logps" in batch:
            kl = kl_penalty(jnp.asarray(batch["old_logps"]), jnp.asarray(batch["ref_logps"]), self.algo.kl_kind,
                            self.algo.kl_clamp, mask=mask)
        return reinforcepp_advantages(jnp.asarray(batch["rewards"]), mask, kl=kl, kl_coef=self.algo.beta,
                                      gamma=self.algo.gamma)
