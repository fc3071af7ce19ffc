"""Per-token policy and value losses: PPO clip (clip-higher, dual-clip), GSPO, value clip.

Every loss returns ``(per_token_loss [N, C], info)``: the loss to *minimise*, 0 on masked
tokens, to be reduced by ``aggregate_loss``; ``info`` holds per-token diagnostics for metrics.
Clip ranges and caps are Python floats (static under jit); they are checked eagerly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes
# LOG_RATIO_BOUND: verl's bound on |log ratio| before exp (exp(20) ~ 4.9e8), for the losses that
# need it: a ratio of 1e30 must give a finite loss and a zero, not NaN, gradient (inf * 0 = NaN).
from rlbolt.algorithms.rollout_correction import LOG_RATIO_BOUND


def _token_advantages(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Broadcasts ``[N]`` sequence advantages to ``[N, 1]``; checks ``[N, C]`` ones."""
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    if advantages.ndim == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(
                f"advantages [N] has N={advantages.shape[0]} but completion_mask is {mask.shape}"
            )
        return advantages[:, None]
    check_token_shapes("advantages", advantages, mask)
    return advantages


def _log_ratio(logps: jax.Array, old_logps: jax.Array, mask: jax.Array) -> jax.Array:
    check_token_shapes("logps", logps, mask)
    check_token_shapes("old_logps", old_logps, mask)
    # Zero on padding so exp() never sees garbage logps there (no inf/NaN in grads).
    return jnp.where(mask, logps - jax.lax.stop_gradient(old_logps), 0.0)


def clipped_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    importance_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with clip-higher and optional dual-clip, per token.

    PPO (arXiv 1707.06347), Eq. 7: ``L = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``
    with ``rho = exp(logp - old_logp)``. DAPO (arXiv 2503.14476), Eq. 10 ("clip-higher"):
    separate ``eps_low`` / ``eps_high`` (e.g. 0.2 / 0.28) so low-probability tokens can grow.
    Dual-clip (Ye et al., arXiv 1912.09729, Eq. 5): for ``A < 0`` the objective is also
    bounded below by ``c * A`` (``c > 1``), so a huge ratio on a bad token cannot blow up the
    loss: ``L = min(L, -c A)`` where ``A < 0``. Truncated importance weights (for stale,
    asynchronously generated samples) multiply the per-token loss.

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs of the completion tokens.
        old_logps: ``[N, C]`` float32 log-probs of the policy the update starts from.
        advantages: ``[N]`` (shared by a sequence's tokens) or ``[N, C]``.
        mask: ``[N, C]`` bool completion mask.
        clip_low: eps_low; the ratio is clipped below at ``1 - clip_low``.
        clip_high: eps_high; the ratio is clipped above at ``1 + clip_high``.
        dual_clip: c > 1 for dual-clip, or None to disable.
        importance_weights: ``[N, C]`` weights (see ``rollout_correction``) or None.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``ratio`` ``[N, C]``, ``clipped`` ``[N, C]``
        bool (the clipped branch was active, so the token has no gradient) and
        ``dual_clipped`` ``[N, C]`` bool.
    """
    mask = jnp.asarray(mask, bool)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (Ye et al. use 3) or None")
    advantages = _token_advantages(advantages, mask)
    ratio = jnp.exp(_log_ratio(logps, old_logps, mask))
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -jnp.minimum(unclipped, clipped)
    is_clipped = (clipped < unclipped) & mask
    is_dual_clipped = jnp.zeros_like(mask)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        is_dual_clipped = (advantages < 0) & (loss > bound) & mask
        loss = jnp.where(advantages < 0, jnp.minimum(loss, bound), loss)
    if importance_weights is not None:
        check_token_shapes("importance_weights", importance_weights, mask)
        loss = loss * jax.lax.stop_gradient(importance_weights)
    loss = jnp.where(mask, loss, 0.0)
    info = {"ratio": ratio, "clipped": is_clipped, "dual_clipped": is_dual_clipped}
    return loss, info


def gspo_surrogate(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO: a clipped surrogate on the length-normalised sequence ratio, in token form.

    GSPO (arXiv 2507.18071), Eq. 7: ``s_i = exp(1/|y_i| sum_t (logp_t - old_logp_t))`` and
    ``J = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``. We use the
    GSPO-token form (Eqs. 13-14): ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, whose value is
    ``s_i`` and whose gradient w.r.t. token t is ``s_i * grad logp_t``. With sequence
    advantages and ``seq-mean-token-mean`` aggregation this equals GSPO exactly (value and
    gradient; the default ``algorithm.policy_loss: gspo`` fills in); token-level advantages
    ``[N, C]`` are also accepted. The paper's clip ranges are tiny (3e-4 / 4e-4) because ``s_i``
    is a geometric mean. ``mask`` is every token ``s_i`` pools: pass a rollout correction's
    keep-mask, so a dropped token is out of the mean, not a term with weight 0.

    Args:
        logps: ``[N, C]`` float32 current-policy log-probs.
        old_logps: ``[N, C]`` float32 old-policy log-probs.
        advantages: ``[N]`` or ``[N, C]``.
        mask: ``[N, C]`` bool: the tokens each row pools (the completion mask or a keep-mask).
        clip_low: eps_low.
        clip_high: eps_high.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``seq_ratio`` ``[N]`` (``s_i``), ``ratio``
        ``[N, C]`` (``s_{i,t}``, numerically ``s_i``) and ``clipped`` ``[N, C]`` bool.
    """
    mask = jnp.asarray(mask, bool)
    advantages = _token_advantages(advantages, mask)
    log_ratio = _log_ratio(logps, old_logps, mask)
    lengths = jnp.maximum(jnp.sum(mask, axis=1), 1)
    seq_log_ratio = jnp.sum(log_ratio, axis=1) / lengths  # [N]
    token_log_ratio = (
        jax.lax.stop_gradient(seq_log_ratio)[:, None]
        + logps
        - jax.lax.stop_gradient(logps)
    )
    ratio = jnp.exp(jnp.where(mask, token_log_ratio, 0.0))
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = jnp.where(mask, -jnp.minimum(unclipped, clipped), 0.0)
    info = {
        "seq_ratio": jnp.exp(seq_log_ratio),
        "ratio": ratio,
        "clipped": (clipped < unclipped) & mask,
    }
    return loss, info


def clipped_value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip: float = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped value loss, per token.

    ``L = 0.5 * max((V - R)^2, (old_V + clip(V - old_V, -c, c) - R)^2)``, the value clipping of
    the PPO reference implementation (baselines ``ppo2``; PPO arXiv 1707.06347 Eq. 9 gives
    the unclipped squared error): the critic may not move more than ``c`` from its old value
    in a direction that the clip would hide.

    Args:
        values: ``[N, C]`` current critic values.
        old_values: ``[N, C]`` critic values when the batch was made.
        returns: ``[N, C]`` targets (from ``gae_advantages``).
        mask: ``[N, C]`` bool completion mask.
        clip: c, the value clip range.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``clipped`` ``[N, C]`` bool: the value moved
        more than ``c`` from its old value and the clipped error was the larger, so the token
        has no gradient (a token within the clip range is never counted).
    """
    mask = jnp.asarray(mask, bool)
    for name, array in (("values", values), ("old_values", old_values), ("returns", returns)):
        check_token_shapes(name, array, mask)
    old_values = jax.lax.stop_gradient(old_values)
    returns = jax.lax.stop_gradient(returns)
    # Where |V - old_V| <= c the clipped value *is* V; computing old_V + (V - old_V) instead
    # can land one ulp off V and count an unclipped token as clipped (value/clip_frac).
    moved = values - old_values
    outside = jnp.abs(moved) > clip
    clipped_values = jnp.where(outside, old_values + jnp.clip(moved, -clip, clip), values)
    error = jnp.square(values - returns)
    clipped_error = jnp.square(clipped_values - returns)
    loss = jnp.where(mask, 0.5 * jnp.maximum(error, clipped_error), 0.0)
    return loss, {"clipped": outside & (clipped_error > error) & mask}
