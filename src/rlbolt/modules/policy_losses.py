"""`algorithm.policy_loss`: the per-token policy objective an LM module trains with, by name.

Each entry maps `(logps [N, C], batch, algorithm section)` to `(per_token_loss [N, C], info)` with
`info["ratio"]` and `info["clipped"]` (the step's `ratio/mean` and `clip_frac`; Clip-Cov and KL-Cov
also their selected tokens, `cov/selected_frac`), calling the pure
functions of `rlbolt.algorithms` with the section's fields.

Rollout correction (`compute_logps`): every objective gets the correction's keep-mask
(`keep_mask`) as its mask, so a token the correction dropped is out of everything an objective
pools (GMPO's and GSPO's sequence ratios and lengths, Clip-Cov's and KL-Cov's covariance means and
selection counts), not a term weighted 0; the aggregation still divides by the completion mask's
totals (a dropped token keeps its place in the normaliser). The weights (`importance_weights`)
multiply the per-token loss, except GMPO's, which takes their geometric mean over the row
(`gmpo_surrogate`). The objectives' paper settings (clip ranges, aggregation) are
`rlbolt.config.sections.POLICY_LOSS_DEFAULTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from rlbolt.algorithms import (
    cispo_surrogate,
    clip_cov_surrogate,
    clipped_surrogate,
    gmpo_surrogate,
    gspo_surrogate,
    kl_cov_surrogate,
    sapo_surrogate,
)

# The info keys holding the tokens a covariance rule selected (Clip-Cov detaches them, KL-Cov
# penalises them): the step's `cov/selected_frac`.
COVARIANCE_SELECTIONS = ("cov_detached", "kl_penalised")

Objective = Callable[[jax.Array, Mapping[str, Any], Any], tuple[jax.Array, dict[str, jax.Array]]]


def _inputs(batch):
    """(old_logps, advantages, mask): the mask is the rollout correction's keep-mask when it ran."""
    mask = batch["keep_mask"] if "keep_mask" in batch else batch["completion_mask"]
    return batch["old_logps"], batch["advantages"], mask


def _weighted(out, batch):
    per_token, info = out
    weights = batch.get("importance_weights")
    return (per_token if weights is None else per_token * jax.lax.stop_gradient(weights)), info


def _micro_batch_key(batch) -> jax.Array:
    """A PRNG key of the micro batch: its first sample's key, so Clip-Cov's draw is reproducible
    and does not depend on where a run was resumed."""
    return jax.random.wrap_key_data(jnp.asarray(batch["sample_keys"][0], jnp.uint32), impl="threefry2x32")


POLICY_LOSSES: dict[str, Objective] = {
    "ppo": lambda logps, batch, a: clipped_surrogate(
        logps, *_inputs(batch), clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
        importance_weights=batch.get("importance_weights")),
    "gspo": lambda logps, batch, a: _weighted(gspo_surrogate(
        logps, *_inputs(batch), clip_low=a.clip_low, clip_high=a.clip_high), batch),
    "cispo": lambda logps, batch, a: _weighted(cispo_surrogate(
        logps, *_inputs(batch), clip_low=a.clip_low, clip_high=a.clip_high), batch),
    "sapo": lambda logps, batch, a: _weighted(sapo_surrogate(
        logps, *_inputs(batch), tau_pos=a.sapo_tau_pos, tau_neg=a.sapo_tau_neg), batch),
    "gmpo": lambda logps, batch, a: gmpo_surrogate(
        logps, *_inputs(batch), clip_low=a.clip_low, clip_high=a.clip_high,
        importance_weights=batch.get("importance_weights")),
    "clip_cov": lambda logps, batch, a: _weighted(clip_cov_surrogate(
        logps, *_inputs(batch), _micro_batch_key(batch), clip_low=a.clip_low, clip_high=a.clip_high,
        select_ratio=a.cov_select_ratio, cov_low=a.clip_cov_low, cov_high=a.clip_cov_high), batch),
    "kl_cov": lambda logps, batch, a: _weighted(kl_cov_surrogate(
        logps, *_inputs(batch), select_ratio=a.cov_select_ratio, kl_coef=a.kl_cov_coef), batch),
}
