"""Newer per-token policy objectives: CISPO, SAPO (soft gate) and GMPO (geometric mean).

Same contract as ``policy_loss.py``: each returns ``(per_token_loss [N, C], info)``, the loss to
*minimise*, 0 on masked tokens, reduced by ``aggregate_loss``; info always has ``ratio`` and
``clipped`` ``[N, C]`` (so the PPO metrics ``ratio/mean`` and ``clip_frac`` work unchanged).
Parameters are Python floats (static under jit), checked eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes
from rlbolt.algorithms.policy_loss import LOG_RATIO_BOUND, _log_ratio, _token_advantages


def cispo_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO: clip the importance-sampling weight (no gradient), never the update.

    MiniMax-M1 (arXiv 2506.13585), the CISPO objective: ``J = sg(r_hat) * A * log pi(y_t)``
    with ``r_hat = clip(r, 1 - eps_low, 1 + eps_high)``, ``r = pi / pi_old``. Unlike PPO every
    token keeps the gradient ``r_hat * A * grad log pi``, also where ``r`` left the clip range
    (PPO's is 0 there).

    Conventions: the paper writes the loss with ``log pi`` itself (verl and TRL too), whose
    *value* carries ``log pi``; we return ``-A * r_hat * (1 + log pi - sg(log pi))``: the same
    gradient, and a value ``-r_hat A`` comparable to PPO's loss. The paper sets no lower bound
    (a large eps_low) and tunes eps_high; ``clip_low=1`` is exactly "no lower bound" (a ratio is
    never below 0). The paper gives no eps_high; our default 4 is ScaleRL's (arXiv 2510.13786)
    cap ``r_hat <= 5`` that TRL recommends (TRL's ``epsilon_high`` is that cap itself, verl's
    ``clip_ratio_high`` is ``eps_high`` as here, defaulting to 0.2 on both sides). The paper
    normalises by the batch's token count: aggregate with ``token-mean`` (the default
    ``algorithm.policy_loss: cispo`` fills in, whatever the algorithm; TRL's ``cispo`` does the same).

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs.
        old_logps: ``[N, C]`` float32 log-probs of the policy the update starts from.
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool completion mask.
        clip_low: eps_low in ``[0, 1]``; the weight is clipped below at ``1 - clip_low``.
        clip_high: eps_high >= 0; the weight is clipped above at ``1 + clip_high``.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``ratio`` ``[N, C]``, ``weight`` ``[N, C]``
        (``r_hat``) and ``clipped`` ``[N, C]`` bool (``r`` left the range; the token still has a
        gradient, only its weight is capped).
    """
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0:
        raise ValueError(f"cispo_surrogate: clip_low={clip_low} must be in [0, 1] (1 = no lower bound) "
                         f"and clip_high={clip_high} >= 0 (e.g. 4.0: weights capped at 5)")
    mask = jnp.asarray(mask, bool)
    advantages = _token_advantages(advantages, mask)
    ratio = jnp.exp(_log_ratio(logps, old_logps, mask))  # may be inf: clipped to 1 + clip_high
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    # Exactly 1 in value (x - x == 0; "1 + x - x" would round), gradient grad log pi.
    unit = 1.0 + (logps - jax.lax.stop_gradient(logps))
    loss = jnp.where(mask, -advantages * weight * unit, 0.0)
    clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)) & mask
    return loss, {"ratio": jax.lax.stop_gradient(ratio), "weight": weight, "clipped": clipped}


def sapo_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SAPO: a smooth, temperature-controlled gate on the ratio instead of PPO's hard clip.

    Soft Adaptive Policy Optimization (arXiv 2511.20347): ``J = f(r) A`` with
    ``f(r) = (4 / tau) * sigmoid(tau (r - 1))``, ``tau = tau_pos`` if ``A > 0`` else ``tau_neg``.
    Its gradient is ``w(r) r A grad log pi`` with ``w = 4 s (1 - s)``, ``s = sigmoid(tau (r -
    1))``: ``w(1) = 1`` (on-policy tokens get the plain policy gradient) and ``w`` decays
    smoothly as ``r`` leaves 1, faster for larger tau. The paper takes ``tau_neg > tau_pos``
    (negative updates spread over the whole vocabulary and destabilise sooner): 1.05 and 1.0.

    Conventions: ``A == 0`` uses ``tau_neg`` (as verl and TRL). The log-ratio is clamped to
    ``+-20`` before ``exp`` (verl's bound; TRL does not clamp): beyond it ``w`` is 0 in float32
    anyway, and the clamp keeps a ratio of ``1e30`` from making ``inf * 0 = NaN`` gradients. The
    paper averages per sequence then over sequences: aggregate with ``seq-mean-token-mean`` (the
    default ``algorithm.policy_loss: sapo`` fills in; verl forces it, TRL's ``sapo`` uses it too).

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs.
        old_logps: ``[N, C]`` float32 old-policy log-probs.
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool completion mask.
        tau_pos: temperature (> 0) for tokens with a positive advantage.
        tau_neg: temperature (> 0) for tokens with a non-positive advantage.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``ratio``, ``gate_weight`` (``w(r)``, the
        factor the gate puts on the policy gradient) and ``clipped`` (all False: nothing is
        hard-clipped), each ``[N, C]``.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo_surrogate: tau_pos={tau_pos} and tau_neg={tau_neg} must be > 0 "
                         "(the paper uses 1.0 and 1.05)")
    mask = jnp.asarray(mask, bool)
    advantages = _token_advantages(advantages, mask)
    log_ratio = jnp.clip(_log_ratio(logps, old_logps, mask), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0))
    loss = jnp.where(mask, -(4.0 / tau) * gate * advantages, 0.0)
    gate = jax.lax.stop_gradient(gate)
    info = {
        "ratio": jax.lax.stop_gradient(ratio),
        "gate_weight": jnp.where(mask, 4.0 * gate * (1.0 - gate), 0.0),
        "clipped": jnp.zeros_like(mask),
    }
    return loss, info


def gmpo_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    importance_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GMPO: the geometric mean of token ratios per sequence, clipped per token in log space.

    Geometric-Mean Policy Optimization (arXiv 2507.20673), its objective: ``J_i = sgn(A_i) * prod_t
    |min(r_t A_i, clip(r_t, e^-eps_low, e^eps_high) A_i)|^(1/|o_i|)``, i.e. ``J_i = A_i * s_i``
    with ``s_i = exp(mean_t c_t)`` and ``c_t = sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t,
    -eps_low, eps_high))``: the PPO pessimistic clip applied to each token's log-ratio, so a
    clipped token stops contributing gradient while the others keep theirs. The paper's range is
    ``(e^-0.4, e^0.4)``.

    Token form: every valid token of row i carries the loss ``-A_i s_i`` (value and full
    gradient of ``s_i``), so ``seq-mean-token-mean`` aggregation (the paper's, and this
    objective's default) gives exactly ``-mean_i A_i s_i``; other aggregations weight rows by
    their length. ``mask`` is every token the row pools: pass a rollout correction's keep-mask,
    so a dropped token is out of ``|o_i|`` and of the product, not a term with weight 0.
    Token-level advantages ``[N, C]`` are averaged over the row's tokens first and that one
    ``A_i`` picks every token's clip side (the paper has one ``A_i``; verl's ``geo_mean``
    averages them the same way for the factor ``A_i`` but clips each token on its own token
    advantage's side). ``A_i == 0`` gives loss 0. The log-ratio is clamped to ``+-20`` (verl
    leaves that clamp commented out): an unclipped side (``A < 0`` and a huge ratio) stays finite.

    Importance weights (rollout correction ``w_t = pi_old / mu``) enter the geometric mean, not
    the loss: ``J_i = A_i * s_i * exp(mean_t log w_t)``. The sampled tokens' ratio to the
    distribution that drew them is ``r_t w_t``, and GMPO's objective is the geometric mean of the
    per-token ratios, so ``prod_t (r_t w_t)^(1/|o_i|) = s_i * G_i(w)``. Multiplying each token's
    loss by ``w_t`` instead would put the arithmetic mean of the row's weights on ``s_i``, the
    very outlier sensitivity GMPO replaces; the two agree when a row shares one weight (a
    sequence-level correction). ``w`` carries no gradient and sits outside the clip, as the
    behaviour correction of decoupled PPO does (verl's ``geo_mean`` takes the same geometric mean).

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs.
        old_logps: ``[N, C]`` float32 old-policy log-probs.
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool: the tokens each row pools (the completion mask, or a rollout
            correction's keep-mask).
        clip_low: eps_low >= 0; token log-ratios are clipped below at ``-clip_low``.
        clip_high: eps_high >= 0; token log-ratios are clipped above at ``clip_high``.
        importance_weights: ``[N, C]`` weights >= 0 (see ``rollout_correction``) or None; their
            geometric mean over ``mask`` multiplies ``s_i``. A weight of 0 on a pooled token
            zeroes its row (drop the token from ``mask`` instead).

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``seq_ratio`` ``[N]`` (``s_i``),
        ``seq_weight`` ``[N]`` (``G_i(w)``, 1 without weights), ``ratio`` ``[N, C]`` (``s_i`` on
        each token of ``mask``, 1 elsewhere) and ``clipped`` ``[N, C]`` bool (the token's
        log-ratio was clipped on its advantage's side, so it has no gradient).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"gmpo_surrogate: clip_low={clip_low} and clip_high={clip_high} must be >= 0 "
                         "(the paper uses 0.4 and 0.4)")
    mask = jnp.asarray(mask, bool)
    lengths = jnp.maximum(jnp.sum(mask, axis=1), 1)
    advantages = _token_advantages(advantages, mask)
    if advantages.shape[1] != 1:
        advantages = (jnp.sum(jnp.where(mask, advantages, 0.0), axis=1) / lengths)[:, None]
    log_ratio = jnp.clip(_log_ratio(logps, old_logps, mask), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sign = jnp.sign(advantages)
    bounded = jnp.clip(log_ratio, -clip_low, clip_high)
    chosen = sign * jnp.minimum(sign * log_ratio, sign * bounded)
    seq_ratio = jnp.exp(jnp.sum(jnp.where(mask, chosen, 0.0), axis=1) / lengths)  # [N]
    seq_weight = jnp.ones_like(seq_ratio)
    if importance_weights is not None:
        check_token_shapes("importance_weights", importance_weights, mask)
        weights = jax.lax.stop_gradient(jnp.asarray(importance_weights, jnp.float32))
        log_weights = jnp.where(mask, jnp.log(jnp.where(mask, weights, 1.0)), 0.0)
        seq_weight = jnp.exp(jnp.sum(log_weights, axis=1) / lengths)
    loss = jnp.where(mask, -advantages * (seq_ratio * seq_weight)[:, None], 0.0)
    clipped = (sign * bounded < sign * log_ratio) & mask
    info = {
        "seq_ratio": jax.lax.stop_gradient(seq_ratio),
        "seq_weight": seq_weight,
        "ratio": jnp.where(mask, jax.lax.stop_gradient(seq_ratio)[:, None], 1.0),  # 1 off the mask, as PPO's
        "clipped": clipped,
    }
    return loss, info
