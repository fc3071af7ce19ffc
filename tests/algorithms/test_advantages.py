"""Group advantages (GRPO, Dr.GRPO, RLOO), REINFORCE++, GAE and group spread vs hand values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbolt.algorithms import (
    drgrpo_advantages,
    gae_advantages,
    group_reward_spread,
    grpo_advantages,
    reinforcepp_advantages,
    rloo_advantages,
)
from rlbolt.algorithms.advantages import _discounted_returns

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.

# The group estimators are jitted in src; the token-level ones run jitted here, as a module's update runs
# them: one compile per function, shape and setting instead of one per primitive.
reinforcepp_advantages = jax.jit(reinforcepp_advantages, static_argnames=("kl_coef", "gamma", "eps"))
gae_advantages = jax.jit(gae_advantages, static_argnames=("gamma", "lam"))
group_reward_spread = jax.jit(group_reward_spread)
_discounted_returns = jax.jit(_discounted_returns, static_argnames=("gamma",))

# Non-contiguous ids, group sizes 2, 3 and 1.
IDS = jnp.array([7, 7, 3, 3, 3, 42])
REWARDS = jnp.array([1.0, 0.0, 2.0, 0.0, 1.0, 5.0])


def test_grpo_unbiased_std_by_hand():
    # group 7: mean .5, std(ddof 1) = sqrt(.5); group 3: mean 1, std(ddof 1) = 1; 42 alone -> 0.
    expected = [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 1.0, -1.0, 0.0, 0.0]
    np.testing.assert_allclose(grpo_advantages(REWARDS, IDS), expected, rtol=1e-5, atol=1e-6)


def test_grpo_population_std_by_hand():
    # group 3 with ddof 0: std = sqrt(2/3).
    s = np.sqrt(2.0 / 3.0)
    expected = [1.0, -1.0, 1.0 / s, -1.0 / s, 0.0, 0.0]
    got = grpo_advantages(REWARDS, IDS, ddof=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_grpo_constant_group_is_zero_not_nan():
    got = grpo_advantages(jnp.array([1.0, 1.0, 1.0, 0.0]), jnp.array([5, 5, 5, 9]))
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 0.0])


def test_drgrpo_and_no_std_grpo_by_hand():
    expected = [0.5, -0.5, 1.0, -1.0, 0.0, 0.0]
    np.testing.assert_allclose(drgrpo_advantages(REWARDS, IDS), expected, atol=1e-6)
    np.testing.assert_allclose(
        grpo_advantages(REWARDS, IDS, scale_by_std=False), expected, atol=1e-6
    )


def test_rloo_by_hand():
    # group 3: 2 - (0+1)/2 = 1.5, 0 - (2+1)/2 = -1.5, 1 - (2+0)/2 = 0.
    expected = [1.0, -1.0, 1.5, -1.5, 0.0, 0.0]
    np.testing.assert_allclose(rloo_advantages(REWARDS, IDS), expected, atol=1e-6)


def test_interleaved_ids_and_jit():
    ids = jnp.array([3, 7, 42, 3, 7, 3])
    rewards = jnp.array([2.0, 1.0, 5.0, 0.0, 0.0, 1.0])
    expected = [1.5, 1.0, 0.0, -1.5, -1.0, 0.0]
    np.testing.assert_allclose(jax.jit(rloo_advantages)(rewards, ids), expected, atol=1e-6)


def test_bad_shapes_raise_naming_field():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(jnp.ones(4), jnp.zeros(3, jnp.int32))


def _numpy_group_reference(rewards, ids):
    """Float64 loops: (grpo ddof1, rloo) advantages."""
    grpo, rloo = np.zeros(len(rewards)), np.zeros(len(rewards))
    for i in range(len(rewards)):
        members = [j for j in range(len(rewards)) if ids[j] == ids[i]]
        group = np.array([rewards[j] for j in members], np.float64)
        if len(group) > 1:
            grpo[i] = (rewards[i] - group.mean()) / (group.std(ddof=1) + 1e-6)
            rloo[i] = rewards[i] - (group.sum() - rewards[i]) / (len(group) - 1)
    return grpo, rloo


@settings(max_examples=25, deadline=None)
@given(
    # A fixed N keeps shapes (and so compiled kernels) the same across examples; group sizes
    # and ids still vary freely, singletons included.
    data=st.lists(
        st.tuples(st.integers(-3, 3), st.integers(0, 4).map(float)), min_size=8, max_size=8
    ),
    relabel_seed=st.integers(0, 1000),
)
def test_group_advantages_match_reference_and_ignore_labels(data, relabel_seed):
    ids = np.array([d[0] for d in data])
    rewards = np.array([d[1] for d in data])
    grpo_ref, rloo_ref = _numpy_group_reference(rewards, ids)
    np.testing.assert_allclose(grpo_advantages(rewards, ids), grpo_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rloo_advantages(rewards, ids), rloo_ref, rtol=1e-5, atol=1e-5)
    # An injective relabelling of the ids must not change anything.
    rng = np.random.default_rng(relabel_seed)
    new_label = dict(zip(range(-3, 4), rng.permutation(1000)[:7] * 13 - 500))
    relabelled = np.array([new_label[i] for i in ids])
    np.testing.assert_allclose(
        grpo_advantages(rewards, relabelled), grpo_advantages(rewards, ids), atol=1e-6
    )
    # Permuting the samples permutes the advantages.
    perm = rng.permutation(len(ids))
    np.testing.assert_allclose(
        rloo_advantages(rewards[perm], ids[perm]), rloo_advantages(rewards, ids)[perm], atol=1e-6
    )


def test_group_reward_spread_by_hand():
    spread = group_reward_spread(jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 3.0]), IDS)
    np.testing.assert_array_equal(spread.range, [0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    # group 3: mean 1/3, squared deviations 1/9 + 4/9 + 1/9 = 6/9, / 3.
    s = np.sqrt(2.0 / 9.0)
    np.testing.assert_allclose(spread.std, [0.0, 0.0, s, s, s, 0.0], atol=1e-6)


MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)


def test_reinforcepp_by_hand():
    kl = jnp.array([[0.1, 0.2, 0.3, 9.0], [0.5, 0.4, 9.0, 9.0]])
    got = reinforcepp_advantages(jnp.array([1.0, -1.0]), MASK, kl=kl, kl_coef=0.5)
    # token rewards: [-.05, -.1, 1 - .15] and [-.25, -1 - .2]; returns-to-go by hand:
    returns = np.array([0.7, 0.75, 0.85, -1.45, -1.2])
    whitened = (returns - returns.mean()) / returns.std()
    expected = np.zeros((2, 4))
    expected[0, :3], expected[1, :2] = whitened[:3], whitened[3:]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_reinforcepp_group_baseline_divides_by_the_std_without_recentring():
    mask = jnp.array([[1, 1], [1, 0], [1, 1]], bool)
    rewards = jnp.array([1.0, 0.0, 3.0])
    got = reinforcepp_advantages(rewards, mask, group_ids=jnp.array([4, 4, 8]))
    # centred rewards .5, -.5, 0 on the last tokens; returns [.5,.5], [-.5], [0, 0]. The baseline
    # already centred each group, so the batch step only divides by the (population) std: the
    # singleton group 8 keeps advantage 0 instead of -mean/std.
    returns = np.array([0.5, 0.5, -0.5, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(got)[np.asarray(mask)], returns / returns.std(), rtol=1e-5)
    assert np.all(np.asarray(got)[2] == 0.0)
    # Without the baseline the same token rewards are centred on the batch mean (Eq. 3).
    token_rewards = jnp.array([[0.0, 0.5], [-0.5, 0.0], [0.0, 0.0]])
    plain = reinforcepp_advantages(token_rewards, mask)
    np.testing.assert_allclose(np.asarray(plain)[np.asarray(mask)], (returns - returns.mean()) / returns.std(), rtol=1e-5)


def test_discounted_returns_skip_mask_holes():
    rewards = jnp.array([[1.0, 5.0, 2.0, 4.0]])
    mask = jnp.array([[1, 0, 1, 1]], bool)
    # G3 = 4, G2 = 2 + .5*4 = 4, G0 = 1 + .5*4 = 3 (the hole neither pays nor discounts).
    got = _discounted_returns(rewards, mask, 0.5)
    np.testing.assert_allclose(got, [[3.0, 0.0, 4.0, 4.0]], atol=1e-6)


def _gae_loop(rewards, values, mask, gamma, lam):
    adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = np.nonzero(mask[i])[0]
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_value = values[i, idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            last = delta + gamma * lam * last
            adv[i, t] = last
            ret[i, t] = last + values[i, t]
    return adv, ret


def test_gae_matches_python_loop_float64():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(4, 7))
    values = rng.normal(size=(4, 7))
    mask = np.zeros((4, 7), bool)
    for i, length in enumerate([7, 3, 1, 5]):
        mask[i, :length] = True
    mask[3, 2] = False  # a hole (e.g. tool output) inside the completion
    mask[1, 0] = False
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = _gae_loop(rewards, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_small_case_by_hand():
    # gamma = lam = 1: A_t = sum_{s>=t} r_s - V_t, returns = reward-to-go.
    adv, ret = gae_advantages(
        jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.5, 0.2, 0.9]]), jnp.ones((1, 3), bool),
        gamma=1.0, lam=1.0,
    )
    np.testing.assert_allclose(adv, [[0.5, 0.8, 0.1]], atol=1e-6)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0]], atol=1e-6)


def test_grpo_process_advantages_by_hand():
    from rlbolt.algorithms import grpo_process_advantages

    # Group 7: step rewards [[1, 0], [0, 0]] -> mean 0.25, population std sqrt(3)/4.
    # Group 9: all ones -> zero spread -> advantage 0.
    step_rewards = np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], np.float32)
    got = np.asarray(grpo_process_advantages(step_rewards, np.array([7, 7, 9, 9])))
    std = np.sqrt(3) / 4
    hi, lo = (1 - 0.25) / std, (0 - 0.25) / std
    np.testing.assert_allclose(got[:2], [[hi + lo, lo], [lo + lo, lo]], rtol=1e-5)  # A_t = sum_{j>=t} r~_j
    np.testing.assert_allclose(got[2:], 0.0, atol=1e-6)


def test_grpo_process_advantages_masked_steps_are_left_out():
    from rlbolt.algorithms import grpo_process_advantages

    # Sample 1's second step is padding: group 3's valid rewards are {1, 0, 0} -> mean 1/3, std sqrt(2)/3.
    step_rewards = np.array([[1.0, 0.0], [0.0, 5.0]], np.float32)
    mask = np.array([[True, True], [True, False]])
    got = np.asarray(grpo_process_advantages(step_rewards, np.array([3, 3]), mask))
    std = np.sqrt(2) / 3
    hi, lo = (1 - 1 / 3) / std, (0 - 1 / 3) / std
    np.testing.assert_allclose(got, [[hi + lo, lo], [lo, 0.0]], rtol=1e-5)
