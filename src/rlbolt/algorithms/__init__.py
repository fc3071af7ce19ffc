"""Pure, jittable RL math: advantages, policy/value losses, KL estimators, loss aggregation,
rollout correction and distillation signals; the policy objectives a config names
(`objectives.py`: `register_objective`)."""

from rlbolt.algorithms.advantages import (
    grpo_process_advantages,
    GroupSpread,
    drgrpo_advantages,
    gae_advantages,
    group_reward_spread,
    grpo_advantages,
    reinforcepp_advantages,
    rloo_advantages,
)
from rlbolt.algorithms.aggregation import LossAggregation, aggregate_loss
from rlbolt.algorithms.covariance import (
    clip_cov_select,
    clip_cov_surrogate,
    kl_cov_select,
    kl_cov_surrogate,
    token_covariance,
)
from rlbolt.algorithms.distillation import distillation_loss, reverse_kl_advantages
from rlbolt.algorithms.groups import (
    dense_group_index,
    group_centred,
    group_count,
    group_mean,
    group_range,
    group_std,
)
from rlbolt.algorithms.kl import KL_KINDS, kl_in_reward, kl_penalty
from rlbolt.algorithms.masked import (
    last_token_one_hot,
    masked_mean,
    masked_whiten,
    sequence_to_token_rewards,
)
from rlbolt.algorithms.policy_loss import (
    clipped_surrogate,
    clipped_value_loss,
    gspo_surrogate,
)
from rlbolt.algorithms.policy_objectives import cispo_surrogate, gmpo_surrogate, sapo_surrogate
from rlbolt.algorithms.objectives import OBJECTIVES, Objective, objective_inputs, register_objective
from rlbolt.algorithms.rollout_correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    rollout_correction,
    truncated_importance_weights,
)
from rlbolt.algorithms.shaping import overlong_penalty

__all__ = [
    "OBJECTIVES",
    "Objective",
    "objective_inputs",
    "register_objective",
    "grpo_process_advantages",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "KL_KINDS",
    "GroupSpread",
    "LossAggregation",
    "aggregate_loss",
    "cispo_surrogate",
    "clip_cov_select",
    "clip_cov_surrogate",
    "clipped_surrogate",
    "clipped_value_loss",
    "dense_group_index",
    "distillation_loss",
    "drgrpo_advantages",
    "gae_advantages",
    "gmpo_surrogate",
    "group_centred",
    "group_count",
    "group_mean",
    "group_range",
    "group_reward_spread",
    "group_std",
    "grpo_advantages",
    "gspo_surrogate",
    "kl_cov_select",
    "kl_cov_surrogate",
    "kl_in_reward",
    "kl_penalty",
    "last_token_one_hot",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "reinforcepp_advantages",
    "reverse_kl_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sapo_surrogate",
    "sequence_to_token_rewards",
    "token_covariance",
    "truncated_importance_weights",
]
