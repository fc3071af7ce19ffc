"""Clip-Cov and KL-Cov: restrain the few tokens whose log-prob/advantage covariance drives entropy down.

"The Entropy Mechanism of RL for Reasoning LMs" (Cui et al., arXiv 2505.22617): entropy
falls with the covariance between a token's log-prob and its advantage, and a handful of tokens
with large covariance cause most of the collapse. Per token, over the N valid tokens passed in,

    Cov_t = (log pi(y_t) - mean log pi) * (A_t - mean A)

- Clip-Cov: draw ``max(1, floor(r N))`` tokens at random among those with
  ``Cov_t in [omega_low, omega_high]`` and detach their gradient. Paper: r = 2e-4, omega = [1, 5].
- KL-Cov: add ``beta * |log pi - log pi_old|`` (a KL-like penalty) to the
  ``max(1, floor(k N))`` tokens of largest Cov_t. Paper: k = 2e-3 (7B) or 2e-4 (32B), beta = 1.

Conventions the paper leaves open, and what verl (``compute_policy_loss_clip_cov`` /
``_kl_cov``, adapted from the authors' code) does:

- The means run over every valid token handed to the loss: with micro-batching, over the micro
  batch (as verl). Pass the whole mini batch to make the selection independent of the split.
  "Valid" is the ``mask`` passed in: with a rollout correction, its keep-mask, so a dropped token
  neither moves the means nor counts toward ``N`` or takes a selection (verl, which replaces its
  ``response_mask`` with the rejection mask, likewise).
- ``log pi`` is the current policy's, without gradient (verl likewise).
- The random draw uses a PRNG key passed in (verl: ``torch.randperm``), so a step is
  reproducible: the chosen tokens are the candidates with the smallest
  ``jax.random.uniform(key, [N, C])``.
- Clip-Cov's base objective: the paper states it on ``r_t A_t``; the authors' code and verl use PPO's
  clipped surrogate and exclude tokens PPO already clipped from the candidates. We follow the
  code. verl zeroes the selected tokens' loss (value and gradient); we stop their gradient and
  keep the value, so the loss metric stays PPO's. verl's bounds are strict (``lo < Cov < hi``);
  the paper's interval is closed, as ours.
- KL-Cov's base objective is the unclipped ``r_t A_t`` (paper and verl alike).
- Counts: ``floor`` as Python's ``int()`` in verl, computed in float32 under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes
from rlbolt.algorithms.moments import segment_centre
from rlbolt.algorithms.policy_loss import _log_ratio, _token_advantages, clipped_surrogate


def token_covariance(logps: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token centred covariance ``(logp - mean logp) * (A - mean A)`` over valid tokens.

    Args:
        logps: ``[N, C]`` log-probs (no gradient flows).
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool completion mask.

    Returns:
        ``[N, C]`` float32, 0 on padding (and everywhere when no token is valid).
    """
    mask = jnp.asarray(mask, bool)
    check_token_shapes("logps", logps, mask)
    adv = jnp.broadcast_to(_token_advantages(advantages, mask), mask.shape)
    logps = jax.lax.stop_gradient(jnp.asarray(logps, jnp.float32))
    index = jnp.zeros((1,), jnp.int32)  # one segment holding every token

    def centred(x):
        # segment_centre: exactly 0 for equal values (equal advantages must give Cov = 0).
        out, _ = segment_centre(x.reshape(1, -1), index, 1, mask.reshape(1, -1))
        return out.reshape(mask.shape)

    return centred(logps) * centred(adv.astype(jnp.float32))


def _select_count(ratio: float, mask: jax.Array) -> jax.Array:
    """``max(1, floor(ratio * valid tokens))``, 0 when no token is valid."""
    valid = jnp.sum(mask)
    count = jnp.floor(ratio * valid.astype(jnp.float32)).astype(jnp.int32)
    return jnp.where(valid > 0, jnp.maximum(count, 1), 0)


def _lowest(scores: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
    """The ``count`` eligible positions of lowest score ([N, C] bool); ties: first in row-major order."""
    flat = jnp.where(eligible, scores, jnp.inf).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return eligible & (rank.reshape(eligible.shape) < count)


def clip_cov_select(
    cov: jax.Array,
    mask: jax.Array,
    key: jax.Array,
    *,
    select_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    exclude: jax.Array | None = None,
) -> jax.Array:
    """Clip-Cov's tokens: a random ``max(1, floor(r N))`` of those with ``cov in [low, high]``.

    Args:
        cov: ``[N, C]`` from ``token_covariance``.
        mask: ``[N, C]`` bool completion mask (N above counts its true entries).
        key: a PRNG key; the draw is ``jax.random.uniform(key, cov.shape)``'s smallest candidates.
        select_ratio: r in ``(0, 1]``.
        cov_low: omega_low.
        cov_high: omega_high (>= cov_low).
        exclude: ``[N, C]`` bool tokens that may not be chosen (PPO-clipped ones), or None.

    Returns:
        ``[N, C]`` bool, the chosen tokens (fewer than asked when there are fewer candidates).
    """
    if not 0.0 < select_ratio <= 1.0 or cov_low > cov_high:
        raise ValueError(f"clip_cov_select: select_ratio={select_ratio} must be in (0, 1] and "
                         f"cov_low={cov_low} <= cov_high={cov_high} (the paper: 2e-4, 1, 5)")
    mask = jnp.asarray(mask, bool)
    check_token_shapes("cov", cov, mask)
    candidates = mask & (cov >= cov_low) & (cov <= cov_high)
    if exclude is not None:
        check_token_shapes("exclude", exclude, mask)
        candidates = candidates & ~jnp.asarray(exclude, bool)
    scores = jax.random.uniform(key, cov.shape)
    return _lowest(scores, candidates, _select_count(select_ratio, mask))


def kl_cov_select(cov: jax.Array, mask: jax.Array, *, select_ratio: float = 2e-3) -> jax.Array:
    """KL-Cov's tokens: the ``max(1, floor(k N))`` valid tokens of largest covariance.

    Args:
        cov: ``[N, C]`` from ``token_covariance``.
        mask: ``[N, C]`` bool completion mask.
        select_ratio: k in ``(0, 1]``.

    Returns:
        ``[N, C]`` bool; ties broken by position (first in row-major order wins).
    """
    if not 0.0 < select_ratio <= 1.0:
        raise ValueError(f"kl_cov_select: select_ratio={select_ratio} must be in (0, 1] (paper: 2e-3 or 2e-4)")
    mask = jnp.asarray(mask, bool)
    check_token_shapes("cov", cov, mask)
    return _lowest(-cov, mask, _select_count(select_ratio, mask))


def clip_cov_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    key: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    select_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped surrogate with Clip-Cov's chosen tokens detached (see the module docstring).

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs.
        old_logps: ``[N, C]`` float32 old-policy log-probs.
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool completion mask.
        key: PRNG key for the random draw (fold in the step and micro-batch index).
        clip_low: PPO eps_low.
        clip_high: PPO eps_high.
        select_ratio: r, the share of valid tokens to detach.
        cov_low: omega_low.
        cov_high: omega_high.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``ratio``, ``clipped`` (the tokens PPO's clip
        cut, the step's ``clip_frac``; never a chosen one, those are excluded from the draw),
        ``cov_detached`` (the chosen tokens, the step's ``cov/selected_frac``: what verl's Clip-Cov
        reports as ``pg_clipfrac``) and ``cov`` ``[N, C]``.
    """
    loss, info = clipped_surrogate(logps, old_logps, advantages, mask, clip_low=clip_low, clip_high=clip_high)
    cov = token_covariance(logps, advantages, mask)
    chosen = clip_cov_select(cov, mask, key, select_ratio=select_ratio, cov_low=cov_low, cov_high=cov_high,
                             exclude=info["clipped"])
    loss = jnp.where(chosen, jax.lax.stop_gradient(loss), loss)
    return loss, {"ratio": info["ratio"], "clipped": info["clipped"], "cov_detached": chosen, "cov": cov}


def kl_cov_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    select_ratio: float = 2e-3,
    kl_coef: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL-Cov: ``-r A`` on every token, plus ``kl_coef * |log r|`` on the top-covariance ones.

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs.
        old_logps: ``[N, C]`` float32 old-policy log-probs.
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool completion mask.
        select_ratio: k, the share of valid tokens penalised.
        kl_coef: beta >= 0.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``ratio``, ``clipped`` (all False),
        ``kl_penalised`` (the chosen tokens), ``abs_log_ratio`` and ``cov`` ``[N, C]``.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_cov_surrogate: kl_coef={kl_coef} must be >= 0 (the paper uses 1)")
    mask = jnp.asarray(mask, bool)
    adv = _token_advantages(advantages, mask)
    log_ratio = _log_ratio(logps, old_logps, mask)
    ratio = jnp.exp(log_ratio)
    cov = token_covariance(logps, advantages, mask)
    chosen = kl_cov_select(cov, mask, select_ratio=select_ratio)
    # |x| as x * sign(x): its gradient at x = 0 is 0 (torch's, so verl's), where jnp.abs's is 1,
    # which on the first update (logps == old_logps) would push every penalised token down.
    abs_log_ratio = log_ratio * jax.lax.stop_gradient(jnp.sign(log_ratio))
    loss = -ratio * adv + jnp.where(chosen, kl_coef * abs_log_ratio, 0.0)
    loss = jnp.where(mask, loss, 0.0)
    info = {"ratio": ratio, "clipped": jnp.zeros_like(mask), "kl_penalised": chosen,
            "abs_log_ratio": jax.lax.stop_gradient(abs_log_ratio), "cov": cov}
    return loss, info
