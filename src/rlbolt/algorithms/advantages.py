"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO), REINFORCE++ and GAE.

Sequence-level estimators take ``rewards [N]`` and ``group_ids [N]`` (any ints, see
``groups.py``) and return ``[N]``. Token-level estimators (REINFORCE++, GAE) return ``[N, C]``
that are 0 on padding. All are pure and jitted (a call compiles one program per input shape, not
one per primitive), and carry no gradient (rewards are data).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlbolt.algorithms import groups
from rlbolt.algorithms.masked import (
    check_token_shapes,
    masked_whiten,
    sequence_to_token_rewards,
)
from rlbolt.algorithms.moments import segment_centre, segment_rms


def _group_moments(rewards: jax.Array, group_ids: jax.Array, ddof: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(centred [N], std [N], size [N]) of each sample's group; centred is exactly 0 in a tied group."""
    groups._check_rewards(rewards, group_ids)
    index = groups.dense_group_index(group_ids)
    n = index.shape[0]
    centred, counts = segment_centre(rewards, index, n)
    return centred, segment_rms(centred, index, n, counts - ddof)[index], counts[index]


# The group estimators are jitted here: modules call them eagerly on the host once per step, where
# their dozen small ops cost ~9 ms un-jitted (benchmarks/RESULTS.md); under an outer jit it is a no-op.
@functools.partial(jax.jit, static_argnames=("eps", "scale_by_std", "ddof"))
def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    eps: float = 1e-6,
    scale_by_std: bool = True,
    ddof: int = 1,
) -> jax.Array:
    """GRPO outcome advantages: the reward z-scored within its group.

    DeepSeekMath (arXiv 2402.03300), Sec. 4.1.2: ``A_i = (r_i - mean(r)) / std(r)`` over the
    G completions of one prompt, shared by every token of completion i.

    The paper does not say which std; we default to the unbiased one (``ddof=1``), the choice of
    the widely used TRL and verl implementations, so results line up with theirs. A group of one
    sample gets advantage 0. A group of identical rewards gets exactly 0, whatever the value and
    the group size (the centring is exact for ties, see ``moments.py``).

    Args:
        rewards: ``[N]`` float, one scalar reward per sample.
        group_ids: ``[N]`` int, the prompt each sample came from (any ids, any group sizes).
        eps: added to the std in the denominator.
        scale_by_std: if False, only subtract the group mean (Dr.GRPO, see
            ``drgrpo_advantages``).
        ddof: std divisor is ``group_size - ddof``.

    Returns:
        ``[N]`` float32 advantages.
    """
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    centred, std, _ = _group_moments(rewards, group_ids, ddof)
    if not scale_by_std:
        return centred
    return centred / (std + eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def grpo_process_advantages(
    step_rewards: jax.Array,
    group_ids: jax.Array,
    mask: jax.Array | None = None,
    *,
    eps: float = 1e-6,
) -> jax.Array:
    """GRPO with process supervision (DeepSeekMath, arXiv 2402.03300, Sec. 4.1.3).

    Every step reward is normalised by the mean and (population) std of all step rewards of its
    group, ``r~ = (r - mean(R)) / (std(R) + eps)``, and token t's advantage is the sum of the
    normalised rewards of the steps at or after t: ``A_t = sum_{j >= t} r~_j``. Here every
    completion token is a step.

    Args:
        step_rewards: ``[N, C]`` float, the reward of each step (token).
        group_ids: ``[N]`` int, any ids; equal ids share a group.
        mask: ``[N, C]`` bool/float, valid steps (default: all). Masked steps are left out of the
            group statistics and get advantage 0.
        eps: added to the std (a group of equal rewards gets advantage 0).

    Returns:
        ``[N, C]`` float32 advantages.
    """
    r = jnp.asarray(step_rewards, jnp.float32)
    m = jnp.ones(r.shape, bool) if mask is None else jnp.asarray(mask, bool)
    check_token_shapes("step_rewards", r, m)
    idx = groups.dense_group_index(group_ids)
    n = r.shape[0]
    centred, count = segment_centre(r, idx, n, m)  # row i's steps all belong to i's group
    std = segment_rms(centred, idx, n, count)
    normed = centred / (std[idx][:, None] + eps)
    return jnp.flip(jnp.cumsum(jnp.flip(normed, axis=1), axis=1), axis=1) * m.astype(jnp.float32)


@jax.jit
def drgrpo_advantages(rewards: jax.Array, group_ids: jax.Array) -> jax.Array:
    """Dr.GRPO advantages: the reward minus its group mean, no std scaling.

    "Understanding R1-Zero-Like Training" (arXiv 2503.20783), Sec. 3.2 / Alg. 1: dividing by
    the group std up-weights prompts that are too easy or too hard (question-level difficulty
    bias), so Dr.GRPO uses ``A_i = r_i - mean(r)``. Pair with the
    ``seq-mean-token-sum-norm`` loss aggregation to also remove the length bias.

    Args:
        rewards: ``[N]`` float.
        group_ids: ``[N]`` int.

    Returns:
        ``[N]`` float32 advantages.
    """
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


@jax.jit
def rloo_advantages(rewards: jax.Array, group_ids: jax.Array) -> jax.Array:
    """REINFORCE leave-one-out advantages.

    Ahmadian et al., "Back to Basics" (arXiv 2402.14740), Eq. 7 (after Kool et al. 2019):
    ``A_i = r_i - 1/(k-1) * sum_{j != i} r_j`` for a group of k samples, which equals
    ``k/(k-1) * (r_i - mean(r))``. A group of one sample has no baseline and gets 0.

    Args:
        rewards: ``[N]`` float.
        group_ids: ``[N]`` int.

    Returns:
        ``[N]`` float32 advantages.
    """
    # The k/(k-1) form: centring is exact for ties, while r_i - (sum - r_i)/(k-1) rounds twice.
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    centred, _, size = _group_moments(rewards, group_ids, 0)
    return jnp.where(size > 1, centred * (size / jnp.maximum(size - 1.0, 1.0)), 0.0)


def _discounted_returns(token_rewards: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    """``G_t = r_t + gamma * G_{t'}`` with t' the next valid token; masked tokens are skipped."""

    def step(carry, inputs):
        reward, valid = inputs
        ret = reward + gamma * carry
        return jnp.where(valid, ret, carry), jnp.where(valid, ret, 0.0)

    init = jnp.zeros(token_rewards.shape[:1], token_rewards.dtype)
    _, returns = jax.lax.scan(step, init, (token_rewards.T, mask.T), reverse=True)
    return returns.T


@jax.jit
def reinforcepp_advantages(
    rewards: jax.Array,
    mask: jax.Array,
    *,
    kl: jax.Array | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_ids: jax.Array | None = None,
    eps: float = 1e-8,
) -> jax.Array:
    """REINFORCE++ advantages: KL-shaped returns-to-go, whitened over the global batch.

    REINFORCE++ (arXiv 2501.03262), Sec. 3: the token reward is
    ``r_t = 1[t = last] * r(x, y) - beta * KL_t`` (Eq. 1), the advantage is the return-to-go
    ``A_t = sum_{s >= t} gamma^(s-t) r_s`` and it is normalised with the mean and std of all
    valid tokens in the batch (Eq. 3; population std). Call it on the whole global batch so
    the statistics are global, not per micro batch. With ``group_ids`` the sequence reward
    first has its group mean removed ("REINFORCE++-baseline") and the batch step then only
    divides by the std: the baseline has already centred every group, and a second centring
    on the token-weighted batch mean would give a group whose samples all scored the same a
    non-zero, length-driven advantage (the paper's Eq. subtracts it; we do not).

    Masked tokens (padding or holes such as tool output) receive no reward, are skipped by the
    discount, and come back as 0.

    Args:
        rewards: ``[N]`` sequence rewards (credited to each row's last valid token) or
            ``[N, C]`` token rewards.
        mask: ``[N, C]`` bool completion mask.
        kl: ``[N, C]`` per-token KL estimate (e.g. ``kl_penalty(..., "k1")``), or None.
        kl_coef: beta, the KL penalty weight.
        gamma: discount factor (the paper uses 1).
        group_ids: ``[N]`` int; if given, subtract each group's mean sequence reward first.
        eps: added to the std in the normalisation.

    Returns:
        ``[N, C]`` float32 advantages, 0 on masked tokens.
    """
    mask = jnp.asarray(mask, bool)
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    if group_ids is not None:
        if rewards.ndim != 1:
            raise ValueError(
                "reinforcepp_advantages: group_ids (the group baseline) needs sequence "
                f"rewards [N], got rewards of shape {rewards.shape}"
            )
        rewards = _group_moments(rewards, group_ids, 0)[0]
    if rewards.ndim == 1:
        token_rewards = sequence_to_token_rewards(rewards, mask)
    else:
        check_token_shapes("rewards", rewards, mask)
        token_rewards = jnp.where(mask, rewards, 0.0)
    if kl is not None:
        check_token_shapes("kl", kl, mask)
        kl = jax.lax.stop_gradient(jnp.asarray(kl, jnp.float32))
        token_rewards = token_rewards - kl_coef * jnp.where(mask, kl, 0.0)
    returns = _discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=eps, centre=group_ids is None)


@jax.jit
def gae_advantages(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation for PPO with a token-level critic.

    Schulman et al., GAE (arXiv 1506.02438), Eq. 16: ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = sum_l (gamma lam)^l delta_{t+l}``, computed backwards as
    ``A_t = delta_t + gamma lam A_{t+1}`` with a reverse ``lax.scan``. The value after the last
    valid token is 0 (the episode ends). Masked tokens are skipped: ``t+1`` means the next
    valid token. Returns are ``A_t + V_t``, the critic's regression target (PPO, 1707.06347).
    No whitening here; use ``masked_whiten`` if wanted.

    Args:
        rewards: ``[N, C]`` float token rewards (see ``kl_in_reward``).
        values: ``[N, C]`` float critic values ``V(s_t)``.
        mask: ``[N, C]`` bool completion mask.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[N, C]`` float32 and 0 on masked tokens.
    """
    mask = jnp.asarray(mask, bool)
    check_token_shapes("rewards", rewards, mask)
    check_token_shapes("values", values, mask)
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    values = jax.lax.stop_gradient(jnp.asarray(values, jnp.float32))

    def step(carry, inputs):
        next_value, next_advantage = carry
        reward, value, valid = inputs
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        carry = (
            jnp.where(valid, value, next_value),
            jnp.where(valid, advantage, next_advantage),
        )
        return carry, jnp.where(valid, advantage, 0.0)

    zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
    _, advantages = jax.lax.scan(
        step, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True
    )
    advantages = advantages.T
    returns = jnp.where(mask, advantages + values, 0.0)
    return advantages, returns


class GroupSpread(NamedTuple):
    """How much the rewards of each sample's group differ (both ``[N]`` float32)."""

    std: jax.Array
    range: jax.Array


@jax.jit
def group_reward_spread(rewards: jax.Array, group_ids: jax.Array) -> GroupSpread:
    """Per-sample spread of its group's rewards, for DAPO's dynamic sampling filter.

    DAPO (arXiv 2503.14476), Eq. 11: keep only groups with ``0 < #correct < G``, i.e. groups
    whose rewards are not all equal, since such a group has zero advantage everywhere and no
    gradient. Filter with ``spread.range > 0`` (exact for identical floats) or
    ``spread.std > tol``.

    Args:
        rewards: ``[N]`` float.
        group_ids: ``[N]`` int.

    Returns:
        ``GroupSpread(std, range)``: the population std (ddof 0) and max - min of the
        sample's group, each ``[N]``.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    return GroupSpread(
        std=groups.group_std(rewards, group_ids, ddof=0),
        range=groups.group_range(rewards, group_ids),
    )
