"""KL(pi || pi_ref) estimators from sampled tokens, as a loss term or folded into rewards.

Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html): with tokens
sampled from pi and ``log_r = logp_ref - logp`` (so ``r = pi_ref / pi``),

- k1 = ``-log_r``                 unbiased, high variance, can be negative;
- k2 = ``0.5 * log_r^2``          biased, low variance, >= 0;
- k3 = ``r - 1 - log_r``          unbiased, low variance, >= 0 (GRPO, arXiv 2402.03300 Eq. 4).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes, sequence_to_token_rewards

KLKind = Literal["k1", "k2", "k3"]
KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(
    logps: jax.Array,
    ref_logps: jax.Array,
    kind: KLKind = "k3",
    clamp: float | None = None,
    *,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref), differentiable w.r.t. ``logps``.

    See the module docstring for the three estimators. As a loss term (GRPO's
    ``+ beta * KL``), reduce it with ``aggregate_loss`` like the policy loss.

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs of the sampled tokens.
        ref_logps: ``[N, C]`` float32 reference-policy log-probs (no gradient).
        kind: "k1", "k2" or "k3".
        clamp: if given, the estimate is clipped to ``[-clamp, clamp]`` (k3's ``exp`` can
            explode when the policies drift far apart; verl uses 10).
        mask: ``[N, C]`` bool; if given, masked positions return 0 and never reach ``exp``
            (recommended: padding logps may be garbage, and ``inf * 0`` is NaN).

    Returns:
        ``[N, C]`` float32 per-token KL estimates.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind={kind!r} is not one of {list(KL_KINDS)}")
    logps = jnp.asarray(logps, jnp.float32)
    ref_logps = jax.lax.stop_gradient(jnp.asarray(ref_logps, jnp.float32))
    if logps.shape != ref_logps.shape:
        raise ValueError(
            f"logps {logps.shape} and ref_logps {ref_logps.shape} must have the same [N, C] shape"
        )
    log_r = ref_logps - logps
    if mask is not None:
        check_token_shapes("logps", logps, mask)
        log_r = jnp.where(mask, log_r, 0.0)
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * jnp.square(log_r)
    else:
        # expm1 keeps precision when the policies are close (r - 1 is tiny).
        kl = jnp.expm1(log_r) - log_r
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return kl


def kl_in_reward(
    rewards: jax.Array,
    logps: jax.Array,
    ref_logps: jax.Array,
    mask: jax.Array,
    beta: float,
    kind: KLKind = "k1",
    *,
    per_token: bool = True,
    clamp: float | None = None,
) -> jax.Array:
    """Folds a KL penalty into the reward (the InstructGPT / PPO-RLHF / REINFORCE++ shaping).

    ``r_t = 1[t = last valid token] * r - beta * KL_t`` (REINFORCE++, arXiv 2501.03262, Eq. 1;
    Ouyang et al. 2203.02155, Eq. 2). The KL estimate carries no gradient: here it is part of
    the reward, not of the loss.

    Args:
        rewards: ``[N]`` float sequence rewards.
        logps: ``[N, C]`` log-probs of the policy that sampled (usually the old logps).
        ref_logps: ``[N, C]`` reference-policy log-probs.
        mask: ``[N, C]`` bool completion mask.
        beta: KL coefficient.
        kind: KL estimator, see ``kl_penalty`` ("k1" is the usual choice in rewards).
        per_token: True returns the ``[N, C]`` token rewards above (for GAE / REINFORCE++);
            False returns ``[N]`` sequence rewards ``r - beta * sum_t KL_t``, the sum over
            valid tokens of the per-token form.
        clamp: passed to ``kl_penalty``.

    Returns:
        ``[N, C]`` float32 token rewards (0 on masked tokens) if ``per_token``, else ``[N]``.
    """
    mask = jnp.asarray(mask, bool)
    kl = jax.lax.stop_gradient(
        kl_penalty(logps, ref_logps, kind, clamp, mask=mask)
    )
    kl = beta * jnp.where(mask, kl, 0.0)
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    if per_token:
        return sequence_to_token_rewards(rewards, mask) - kl
    # Summed directly so a sample with an empty mask still keeps its reward.
    return rewards - jnp.sum(kl, axis=1)
