"""PPO for LMs (Ouyang et al. 2203.02155 / PPO 1707.06347) with a value head on the policy trunk.

Where it departs from the usual RLHF PPO: the critic is a linear value head on the policy's
final hidden states (`Decoder(..., return_hidden=True)`), not a separate model, so one forward
gives logps, entropy and values and the value loss also trains the shared trunk (weighted by
`algorithm.value_coef`). Rewards: the sequence reward on the last token minus beta * KL_t
(k-estimator `algorithm.kl_kind`, old vs reference logps) when beta > 0; advantages by GAE
(`gamma`, `lam`) on the old values, whitened over the global batch; PPO-clip policy loss and
the clipped value loss (`value_clip`). Trainable params: {"policy": nnx.State, "value_head":
{"kernel": [H, 1], "bias": [1]}}.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rlbolt.algorithms import clipped_value_loss, gae_advantages, kl_in_reward, masked_whiten, sequence_to_token_rewards
from rlbolt.batch import Batch, register_column
from rlbolt.modules.policy import LMPolicyModule
from rlbolt.rollout.logps import chunked_logps, completion_hidden

register_column("old_values", "[N, C]", "float32", "the value head's values at the rollout (PPO)", by=__name__)
register_column("returns", "[N, C]", "float32", "GAE's value targets (PPO)", by=__name__)


class PPO(LMPolicyModule):
    """PPO with GAE and a value head (see the module docstring)."""

    algorithm_name = "ppo"
    algorithm_defaults = {"loss_aggregation": "token-mean"}
    kl_in_loss = False

    def setup(self, context) -> None:
        """The base set-up, plus a jitted value-head forward for `compute_logps`."""
        super().setup(context)
        rows = {} if self.sharding is None else {"out_shardings": self.sharding.batch_sharding()}
        self._values = jax.jit(lambda params, *inputs, group_size: self._hidden_outputs(
            params, *inputs, with_entropy=False, group_size=group_size)[2], static_argnames="group_size", **rows)

    def init_params(self, rng: jax.Array) -> dict[str, Any]:
        """`{"policy": the model's nnx.Param state, "value_head": {"kernel": [H, 1], "bias": [1]}}`."""
        hidden = self.model.config.hidden_size
        # Small init: the first values are ~0, so early advantages are ~ the rewards themselves.
        kernel = 1e-3 * jax.random.normal(rng, (hidden, 1), jnp.float32)
        return {"policy": super().init_params(rng), "value_head": {"kernel": kernel, "bias": jnp.zeros((1,), jnp.float32)}}

    def policy_params(self, params: Any) -> Any:
        """The language model's part of the trainable pytree: `params["policy"]`."""
        return params["policy"]

    def with_frozen(self, params: Any, frozen: Any) -> Any:
        return {**params, "policy": super().with_frozen(params["policy"], frozen)}

    def _hidden_outputs(self, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *, with_entropy: bool,
                        group_size: int):
        hidden, weight = completion_hidden(self.graphdef, params["policy"], prompt_ids, prompt_mask,
                                            completion_ids, completion_mask, group_size)
        logps, entropy = chunked_logps(hidden, weight, completion_ids.astype(jnp.int32), self._train_temperature,
                                        self.config.model.logits_chunk_tokens, with_entropy,
                                        self.model.config.final_logit_softcapping)  # Gemma 2
        head = params["value_head"]
        values = (hidden.astype(jnp.float32) @ head["kernel"])[..., 0] + head["bias"][0]  # [B, C]
        mask = completion_mask.astype(bool)
        return jnp.where(mask, logps, 0.0), jnp.where(mask, entropy, 0.0), jnp.where(mask, values, 0.0)

    def compute_logps(self, params: Any, batch: Batch) -> Batch:
        """Adds old_logps / ref_logps (see the base) and `old_values` [N, C] from the value head."""
        batch = super().compute_logps(params, batch)
        values = self._values(self.full_params(params), *self._rows_on_mesh(batch),
                              group_size=self.logps_group_size(batch))
        return batch.with_columns(old_values=self._local(values))

    def compute_advantages(self, batch: Batch):
        """PPO: GAE (gamma, lam) over token rewards (the sequence reward on the last token, minus
        beta * KL_t when beta > 0) and the old values; returns {"advantages": whitened over the
        global batch, "returns": the value targets}, both [N, C]."""
        mask = jnp.asarray(batch["completion_mask"])
        rewards = jnp.asarray(batch["rewards"])
        if self.algo.beta > 0 and "ref_logps" in batch:
            token_rewards = kl_in_reward(rewards, jnp.asarray(batch["old_logps"]), jnp.asarray(batch["ref_logps"]), mask,
                                         self.algo.beta, self.algo.kl_kind, clamp=self.algo.kl_clamp)
        else:
            token_rewards = sequence_to_token_rewards(rewards, mask)
        advantages, returns = gae_advantages(token_rewards, jnp.asarray(batch["old_values"]), mask,
                                             gamma=self.algo.gamma, lam=self.algo.lam)
        return {"advantages": masked_whiten(advantages, mask), "returns": returns}

    def forward(self, params: Any, batch: Batch):
        """One trunk forward: (logps [N, C], entropy [N, C], {"values": [N, C]})."""
        logps, entropy, values = self._hidden_outputs(params, *self._token_inputs(batch), with_entropy=True,
                                                      group_size=self.train_group_size)
        return logps, entropy, {"values": values}

    def extra_loss(self, aux, batch: Batch):
        """value_coef * the clipped value loss (clip range `value_clip`), aggregated like the policy loss."""
        per_token, info = clipped_value_loss(aux["values"], batch["old_values"], batch["returns"],
                                             batch["completion_mask"], clip=self.algo.value_clip)
        value_loss = self.aggregate(per_token, batch)
        metrics = {"loss/value": self.algo.value_coef * value_loss, "value/clip_frac": self.token_mean(info["clipped"], batch),
                   "value/mean": self.token_mean(aux["values"], batch)}
        return self.algo.value_coef * value_loss, metrics
