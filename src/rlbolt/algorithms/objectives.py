"""`algorithm.policy_loss`: the per-token policy objectives a config can name, each registered
where it is defined with its paper's settings.

An objective maps `(logps [N, C], batch, algorithm section)` to `(per_token_loss [N, C], info)`
with `info["ratio"]` and `info["clipped"]` (the step's `ratio/mean` and `clip_frac`; Clip-Cov and
KL-Cov also their selected tokens, `cov/selected_frac`), calling the pure functions of
`rlbolt.algorithms` with the section's fields. Its registration declares the fields it fills
when the config left them None (`defaults`: clip ranges, ...) and the loss aggregation its paper
trains with (`aggregation`); both win over the algorithm's own defaults, and a value the config
sets wins over both. An objective that declares no aggregation (ppo, clip_cov, kl_cov: PPO's
per-token surrogate) trains with the algorithm's.

Adding one touches one file, the one that defines it (imported before the config is read):

    @register_objective("my-clip", defaults={"clip_low": 0.1}, aggregation="token-mean")
    def my_clip(logps, batch, algo):
        return clipped_surrogate(logps, *objective_inputs(batch), clip_low=algo.clip_low,
                                 clip_high=algo.clip_high)

Rollout correction (`compute_logps`): every objective gets the correction's keep-mask
(`keep_mask`) as its mask (`objective_inputs`), so a token the correction dropped is out of
everything an objective pools (GMPO's and GSPO's sequence ratios and lengths, Clip-Cov's and
KL-Cov's covariance means and selection counts), not a term weighted 0; the aggregation still
divides by the completion mask's totals (a dropped token keeps its place in the normaliser). The
weights (`importance_weights`) multiply the per-token loss (`importance_weighted`), except GMPO's,
which takes their geometric mean over the row (`gmpo_surrogate`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from rlbolt.algorithms.covariance import clip_cov_surrogate, kl_cov_surrogate
from rlbolt.algorithms.policy_loss import clipped_surrogate, gspo_surrogate
from rlbolt.algorithms.policy_objectives import cispo_surrogate, gmpo_surrogate, sapo_surrogate
from rlbolt.utils.registry import Registry

ObjectiveFn = Callable[[jax.Array, Mapping[str, Any], Any], tuple[jax.Array, dict[str, jax.Array]]]


@dataclass(frozen=True)
class Objective:
    """A registered policy objective.

    Attributes:
      fn: `(logps, batch, algorithm section) -> (per_token_loss, info)`.
      defaults: algorithm fields it fills when the config left them None (its paper's settings).
      aggregation: the `loss_aggregation` its paper trains with; None: the algorithm's.
      selections: info keys holding the tokens a selection rule picked (the step's
        `cov/selected_frac`).
    """

    fn: ObjectiveFn
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aggregation: str | None = None
    selections: tuple[str, ...] = ()

    def fills(self) -> dict[str, Any]:
        """The algorithm fields this objective fills when left None (its aggregation included)."""
        return {**self.defaults, **({"loss_aggregation": self.aggregation} if self.aggregation else {})}

    def __call__(self, logps: jax.Array, batch: Mapping[str, Any], algo: Any) -> tuple[jax.Array, dict]:
        return self.fn(logps, batch, algo)


OBJECTIVES: Registry[Objective] = Registry("policy objective", "algorithm.policy_loss",
                                           ready=("rlbolt.algorithms.objectives",))


def register_objective(name: str, *, defaults: Mapping[str, Any] | None = None, aggregation: str | None = None,
                       selections: tuple[str, ...] = ()) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """A decorator registering `fn(logps, batch, algo)` as the objective `algorithm.policy_loss: name`.

    Args:
      name: the name a config gives.
      defaults: algorithm fields filled when the config left them None (the paper's settings).
      aggregation: the paper's `loss_aggregation` (one of `rlbolt.config.sections.LOSS_AGGREGATIONS`);
        None: the algorithm's.
      selections: info keys holding the tokens a selection rule picked (logged as `cov/selected_frac`).

    Returns:
      The decorator; it returns the function unchanged.
    """
    def register(fn: ObjectiveFn) -> ObjectiveFn:
        OBJECTIVES.register(name, Objective(fn, dict(defaults or {}), aggregation, tuple(selections)),
                            owner=f"{fn.__module__}.{fn.__qualname__}")
        return fn

    return register


def objective_selections() -> tuple[str, ...]:
    """Every registered objective's selection info keys (each once, in registration order)."""
    return tuple(dict.fromkeys(k for n in OBJECTIVES.names() for k in OBJECTIVES.get(n).selections))


def objective_inputs(batch: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(old_logps, advantages, mask): the mask is the rollout correction's keep-mask when it ran."""
    mask = batch["keep_mask"] if "keep_mask" in batch else batch["completion_mask"]
    return batch["old_logps"], batch["advantages"], mask


def importance_weighted(out: tuple[jax.Array, dict], batch: Mapping[str, Any]) -> tuple[jax.Array, dict]:
    """An objective's `(per_token, info)` with the per-token loss times the rollout correction's
    `importance_weights` (no gradient through them), when the batch has them."""
    per_token, info = out
    weights = batch.get("importance_weights")
    return (per_token if weights is None else per_token * jax.lax.stop_gradient(weights)), info


def _micro_batch_key(batch: Mapping[str, Any]) -> jax.Array:
    """A PRNG key of the micro batch: its first sample's key, so Clip-Cov's draw is reproducible
    and does not depend on where a run was resumed."""
    return jax.random.wrap_key_data(jnp.asarray(batch["sample_keys"][0], jnp.uint32), impl="threefry2x32")


@register_objective("ppo")
def ppo(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip with clip-higher and dual-clip (`clipped_surrogate`)."""
    return clipped_surrogate(logps, *objective_inputs(batch), clip_low=a.clip_low, clip_high=a.clip_high,
                             dual_clip=a.dual_clip, importance_weights=batch.get("importance_weights"))


# GSPO (arXiv 2507.18071), SAPO (arXiv 2511.20347), GMPO (arXiv 2507.20673): a mean over each
# sequence's tokens, then over sequences (exactly the sequence objective in GSPO's and GMPO's token forms).
@register_objective("gspo", aggregation="seq-mean-token-mean")
def gspo(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO's sequence-level ratio (`gspo_surrogate`)."""
    return importance_weighted(gspo_surrogate(logps, *objective_inputs(batch), clip_low=a.clip_low,
                                              clip_high=a.clip_high), batch)


# MiniMax-M1 (arXiv 2506.13585): no lower bound, an upper cap of 5; normalised by the batch's token count.
@register_objective("cispo", defaults={"clip_low": 1.0, "clip_high": 4.0}, aggregation="token-mean")
def cispo(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO's clipped importance weight, every token keeps its gradient (`cispo_surrogate`)."""
    return importance_weighted(cispo_surrogate(logps, *objective_inputs(batch), clip_low=a.clip_low,
                                               clip_high=a.clip_high), batch)


@register_objective("sapo", aggregation="seq-mean-token-mean")
def sapo(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SAPO's soft sigmoid gate (`sapo_surrogate`)."""
    return importance_weighted(sapo_surrogate(logps, *objective_inputs(batch), tau_pos=a.sapo_tau_pos,
                                              tau_neg=a.sapo_tau_neg), batch)


@register_objective("gmpo", defaults={"clip_low": 0.4, "clip_high": 0.4}, aggregation="seq-mean-token-mean")
def gmpo(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GMPO's geometric mean of token ratios, clipped in log space (`gmpo_surrogate`)."""
    return gmpo_surrogate(logps, *objective_inputs(batch), clip_low=a.clip_low, clip_high=a.clip_high,
                          importance_weights=batch.get("importance_weights"))


# Clip-Cov and KL-Cov (arXiv 2505.22617): the share of tokens of highest log-prob/advantage covariance.
@register_objective("clip_cov", defaults={"cov_select_ratio": 2e-4}, selections=("cov_detached",))
def clip_cov(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip with the highest-covariance tokens detached (`clip_cov_surrogate`)."""
    return importance_weighted(clip_cov_surrogate(
        logps, *objective_inputs(batch), _micro_batch_key(batch), clip_low=a.clip_low, clip_high=a.clip_high,
        select_ratio=a.cov_select_ratio, cov_low=a.clip_cov_low, cov_high=a.clip_cov_high), batch)


@register_objective("kl_cov", defaults={"cov_select_ratio": 2e-3}, selections=("kl_penalised",))
def kl_cov(logps: jax.Array, batch: Mapping[str, Any], a: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's surrogate with a KL penalty on the highest-covariance tokens (`kl_cov_surrogate`)."""
    return importance_weighted(kl_cov_surrogate(logps, *objective_inputs(batch), select_ratio=a.cov_select_ratio,
                                                kl_coef=a.kl_cov_coef), batch)
