"""Rollout correction: importance weights and masks for samples whose logps are not the trainer's.

The rollout's log-probs ``mu(y_t)`` (another engine, bf16 sampling, a stale policy in async mode)
are not the trainer's ``pi_old(y_t)``, so the policy-gradient estimate is taken under the wrong
measure. With ``rho_t = pi_old(y_t) / mu(y_t)`` (computed as ``exp(old_logp - rollout_logp)``):

- ``tis``: truncated importance sampling, weight ``min(rho, cap)`` (IMPALA's V-trace, arXiv
  1802.01561 Eq. 1; Yao et al., "Your efficient RL framework secretly brings you off-policy RL
  training", 2025). Nothing is dropped.
- ``mis``: masked importance sampling: tokens (or whole sequences) whose ratio leaves
  ``[lo, hi]`` (default ``[1/cap, cap]``) are dropped; the kept ones are weighted by ``rho``
  (Liu, Li et al., "When speed kills stability", 2025; TRL's ``token_mask`` / ``sequence_mask``).
- ``icepop``: IcePop (Ring-1T, arXiv 2510.18855): ``M(rho) = rho if alpha <= rho <= beta
  else 0`` per token, i.e. token-level ``mis`` with the paper's ``[alpha, beta] = [0.5, 5]``.
- ``mask``: rejection only: tokens or sequences outside ``[lo, hi]`` are dropped, kept ones
  weigh 1 (verl's ``rollout_rs`` with ``token_k1`` / ``seq_sum_k1`` bounds, no ``rollout_is``).
- ``none``: weights 1, nothing dropped; only the metrics (monitor the mismatch first).

The ratio per ``level``: ``token`` ``rho_t``; ``sequence`` the product ``prod_t rho_t`` (the
exact trajectory ratio, verl's ``rollout_is: sequence``); ``geometric`` its geometric mean
``exp(mean_t log rho_t)`` (verl's ``seq_mean_k1`` bounds, the length-normalised form of GSPO).
A sequence-level weight is shared by every token of its row; a sequence-level mask drops the
whole row. Weights carry no gradient and are 0 on padding and on dropped tokens.

Conventions and differences from verl (``verl/trainer/ppo/rollout_corr_helper.py``) and TRL:
verl clamps log-ratios to +-20 before ``exp``; here truncation and masking compare in log space
(or take ``min`` after an ``exp`` that may overflow to ``inf``), so no clamp is needed and a
ratio of ``1e30`` gives exactly ``cap`` (``tis``) or a dropped token (``mis``). Bounds are
closed (``lo <= rho <= hi``), as in verl and TRL. verl's ``*_k1`` rejection bounds apply to its
``k1 = -log rho``, i.e. to ``mu / pi_old``: the same as ours for symmetric ``[1/C, C]``, mirrored
for asymmetric ones (ours, like IcePop's, bound ``pi_old / mu``). TRL's truncation also clamps
from below (``clip_min``); the TIS papers and verl do not, nor do we. verl reports the IS
mean/max before truncation; we report the weights actually applied.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes

LOG_RATIO_BOUND = 20.0
CorrectionMode = Literal["tis", "mis", "icepop", "mask", "none"]
CorrectionLevel = Literal["token", "sequence", "geometric"]
CORRECTION_MODES = ("tis", "mis", "icepop", "mask", "none")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
ICEPOP_BOUNDS = (0.5, 5.0)


def _check_bounds(mode: str, cap: float, bounds: tuple[float, float] | None) -> tuple[float, float]:
    if bounds is None:
        if mode == "icepop":
            return ICEPOP_BOUNDS
        if mode in ("mis", "mask") and cap <= 1.0:
            raise ValueError(f"rollout_correction: cap={cap} must be > 1 for mode={mode!r} "
                             "(tokens outside [1/cap, cap] are dropped), or pass bounds=(lo, hi)")
        return (1.0 / cap, cap)
    lo, hi = (float(b) for b in bounds)
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"rollout_correction: bounds={bounds} must satisfy 0 <= lo <= 1 <= hi "
                         "(e.g. (0.5, 5.0)) so an on-policy token is never dropped")
    return lo, hi


def _log_ratios(old_logps, rollout_logps, mask, level):
    """(token log-ratios [N, C], the level's log-ratio broadcast to [N, C]), 0 on padding."""
    token = jnp.where(mask, jnp.asarray(old_logps, jnp.float32) - jnp.asarray(rollout_logps, jnp.float32), 0.0)
    token = jax.lax.stop_gradient(token)
    if level == "token":
        return token, token
    total = jnp.sum(token, axis=1, keepdims=True)
    if level == "geometric":
        total = total / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)
    return token, jnp.broadcast_to(total, token.shape)


def rollout_correction(
    old_logps: jax.Array,
    rollout_logps: jax.Array,
    mask: jax.Array,
    *,
    mode: CorrectionMode = "tis",
    level: CorrectionLevel = "token",
    cap: float = 2.0,
    bounds: tuple[float, float] | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Importance weights and a keep-mask correcting rollout/trainer mismatch, with metrics.

    Plug the outputs into the loss: ``clipped_surrogate(..., mask=keep_mask,
    importance_weights=weights)`` (and aggregate with ``keep_mask``, or with the original mask
    to keep the normaliser: a choice for the caller; verl replaces ``response_mask``).

    Args:
        old_logps: ``[N, C]`` the trainer's log-probs of the sampled tokens (``pi_old``).
        rollout_logps: ``[N, C]`` the rollout engine's log-probs of the same tokens (``mu``).
        mask: ``[N, C]`` bool completion mask.
        mode: "tis", "mis", "icepop", "mask" or "none" (see the module docstring). Static.
        level: "token", "sequence" (product of ratios) or "geometric" (their geometric mean).
            "icepop" is token-level by definition and refuses another level. Static.
        cap: "tis": the truncation level C (> 0); "mis" / "mask": the default bounds are
            ``[1/C, C]`` (C > 1).
        bounds: ``(lo, hi)`` with ``0 <= lo <= 1 <= hi``, replacing ``[1/cap, cap]`` for "mis"
            and "mask", and IcePop's ``[alpha, beta]`` (default ``(0.5, 5.0)``).

    Returns:
        ``(weights [N, C] float32, keep_mask [N, C] bool, metrics)``. ``weights`` is 0 on padding
        and dropped tokens, exactly 1 everywhere valid when the logps are identical.
        ``keep_mask`` is ``mask`` minus the dropped tokens. ``metrics`` holds float32 scalars
        (masked means over the valid tokens of ``mask``): ``rollout_corr/kl_k1`` (mean of
        ``rollout - old``: KL(mu || pi_old) on mu's samples), ``rollout_corr/kl_k3`` (mean of
        ``rho - 1 - log rho``, its low-variance k3 form, log rho clamped to +-20),
        ``rollout_corr/is_weight_mean`` and ``rollout_corr/is_weight_max`` (of the weights applied, over kept tokens),
        ``rollout_corr/token_masked_frac`` (dropped / valid tokens) and
        ``rollout_corr/seq_masked_frac`` (rows with a dropped token / rows with a valid token).
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout_correction: mode={mode!r} is not one of {list(CORRECTION_MODES)}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"rollout_correction: level={level!r} is not one of {list(CORRECTION_LEVELS)}")
    if mode == "icepop" and level != "token":
        raise ValueError(f"rollout_correction: mode='icepop' is token-level (arXiv 2510.18855); got "
                         f"level={level!r}: use mode='mis' for a sequence-level mask")
    if cap <= 0:
        raise ValueError(f"rollout_correction: cap={cap} must be > 0 (e.g. 2.0)")
    if bounds is not None and mode in ("tis", "none"):
        raise ValueError(f"rollout_correction: bounds={bounds} only apply to modes 'mis', 'icepop' and 'mask' "
                         f"(mode={mode!r} truncates at cap and drops nothing); drop bounds or change mode")
    mask = jnp.asarray(mask, bool)
    check_token_shapes("old_logps", old_logps, mask)
    check_token_shapes("rollout_logps", rollout_logps, mask)
    token_lr, log_ratio = _log_ratios(old_logps, rollout_logps, mask, level)

    keep = mask
    if mode == "tis":
        # min after exp: an overflow to inf truncates to cap exactly; exp(0) == 1 exactly.
        weights = jnp.minimum(jnp.exp(log_ratio), cap)
    elif mode == "none":
        weights = jnp.ones_like(log_ratio)
    else:
        lo, hi = _check_bounds(mode, cap, bounds)
        log_lo = math.log(lo) if lo > 0 else -math.inf
        inside = (log_ratio >= log_lo) & (log_ratio <= math.log(hi))
        keep = mask & inside
        # exp only of kept ratios (<= hi): no overflow.
        weights = jnp.ones_like(log_ratio) if mode == "mask" else jnp.exp(jnp.where(keep, log_ratio, 0.0))
    weights = jax.lax.stop_gradient(jnp.where(keep, weights, 0.0).astype(jnp.float32))
    return weights, keep, _metrics(token_lr, weights, mask, keep)


def _metrics(token_lr, weights, mask, keep) -> dict[str, jax.Array]:
    valid = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    kept = jnp.maximum(jnp.sum(keep), 1).astype(jnp.float32)
    rows = jnp.any(mask, axis=1)
    dropped = mask & ~keep
    # k3 = rho - 1 - log rho; expm1 keeps precision near 0. The log-ratio is clamped to +-20 so a
    # ratio of 1e30 reports ~4.9e8, not inf: metric writers (JSON) need finite numbers. verl's k3_kl
    # metric is unclamped (it can report inf); verl clamps to the same +-20 only in its rejection
    # statistics (token_k3 / seq_*_k3).
    bounded = jnp.clip(token_lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    k3 = jnp.where(mask, jnp.expm1(bounded) - bounded, 0.0)
    return {
        "rollout_corr/kl_k1": jnp.sum(-token_lr) / valid,
        "rollout_corr/kl_k3": jnp.sum(k3) / valid,
        "rollout_corr/is_weight_mean": jnp.sum(jnp.where(keep, weights, 0.0)) / kept,
        "rollout_corr/is_weight_max": jnp.max(jnp.where(keep, weights, 0.0), initial=0.0),
        "rollout_corr/token_masked_frac": jnp.sum(dropped) / valid,
        "rollout_corr/seq_masked_frac": jnp.sum(jnp.any(dropped, axis=1))
        / jnp.maximum(jnp.sum(rows), 1).astype(jnp.float32),
    }


def truncated_importance_weights(
    old_logps: jax.Array,
    behaviour_logps: jax.Array,
    mask: jax.Array,
    cap: float = 2.0,
) -> jax.Array:
    """Token-level truncated importance weights ``min(pi_old / mu, cap)``, 0 on padding.

    ``rollout_correction(..., mode="tis", level="token")``'s weights, kept under this name.

    Args:
        old_logps: ``[N, C]`` log-probs under the policy the update starts from.
        behaviour_logps: ``[N, C]`` log-probs under the policy that generated the sample.
        mask: ``[N, C]`` bool completion mask.
        cap: the truncation level (> 0).

    Returns:
        ``[N, C]`` float32 weights, 0 on masked tokens, no gradient.
    """
    if cap <= 0:
        raise ValueError(f"truncated_importance_weights: cap={cap} must be > 0 (e.g. 2.0)")
    mask = jnp.asarray(mask, bool)
    check_token_shapes("behaviour_logps", behaviour_logps, mask)
    weights, _, _ = rollout_correction(old_logps, behaviour_logps, mask, mode="tis", cap=cap)
    return weights
