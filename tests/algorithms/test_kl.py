"""KL estimators k1/k2/k3 and KL-in-reward shaping vs hand values and Monte Carlo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import kl_in_reward, kl_penalty

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.

LOGPS = jnp.log(jnp.array([[0.5, 0.2]]))
REF = jnp.log(jnp.array([[0.25, 0.4]]))  # log r = ref - logp = [log .5, log 2]


def test_estimators_by_hand():
    l2 = np.log(2.0)
    np.testing.assert_allclose(kl_penalty(LOGPS, REF, "k1"), [[l2, -l2]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(LOGPS, REF, "k2"), [[0.5 * l2**2] * 2], rtol=1e-6)
    # k3 = r - 1 - log r: .5 - 1 + log 2 and 2 - 1 - log 2.
    np.testing.assert_allclose(
        kl_penalty(LOGPS, REF, "k3"), [[l2 - 0.5, 1.0 - l2]], rtol=1e-6
    )


def test_k3_nonnegative_and_clamp():
    rng = np.random.default_rng(1)
    logps = jnp.asarray(rng.normal(scale=3.0, size=(8, 16)), jnp.float32)
    ref = jnp.asarray(rng.normal(scale=3.0, size=(8, 16)), jnp.float32)
    k3 = kl_penalty(logps, ref, "k3")
    assert float(jnp.min(k3)) >= 0.0
    assert float(jnp.max(k3)) > 10.0  # the spread is wide enough for the clamp to bite
    np.testing.assert_array_less(kl_penalty(logps, ref, "k3", clamp=10.0), 10.0 + 1e-6)


def test_mask_keeps_garbage_padding_out_of_grads():
    logps = jnp.array([[-1.0, 500.0]])
    ref = jnp.array([[-1.5, -500.0]])
    mask = jnp.array([[True, False]])
    grad = jax.grad(lambda lp: jnp.sum(kl_penalty(lp, ref, "k3", mask=mask)))(logps)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp).
    np.testing.assert_allclose(grad, [[1.0 - np.exp(-0.5), 0.0]], rtol=1e-6)


def test_k1_k3_unbiased_on_samples():
    # Tokens drawn from p; the mean of k1 and k3 over samples estimates KL(p || q).
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    q = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
    true_kl = float(np.sum(p * np.log(p / q)))
    tokens = np.random.default_rng(0).choice(5, size=(200, 500), p=p)
    logps = jnp.asarray(np.log(p)[tokens], jnp.float32)
    ref = jnp.asarray(np.log(q)[tokens], jnp.float32)
    for kind in ("k1", "k3"):
        samples = np.asarray(kl_penalty(logps, ref, kind), np.float64).ravel()
        stderr = samples.std() / np.sqrt(samples.size)
        assert abs(samples.mean() - true_kl) < 4 * stderr, kind
    # k3 has lower variance than k1 when q is close to p (the reason GRPO uses it).
    assert np.var(kl_penalty(logps, ref, "k3")) < np.var(kl_penalty(logps, ref, "k1"))


def test_bad_kind_lists_allowed():
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(LOGPS, REF, "k4")


def test_kl_in_reward_by_hand():
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
    ref = jnp.zeros((3, 3))
    logps = jnp.array([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0], [9.0, 9.0, 9.0]])
    rewards = jnp.array([1.0, 2.0, 3.0])
    tokens = kl_in_reward(rewards, logps, ref, mask, beta=0.5, kind="k1")
    # k1 = logp - ref; reward on the last valid token; the empty row gets nothing.
    np.testing.assert_allclose(
        tokens, [[-0.05, 0.9, 0.0], [1.85, 0.0, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6
    )
    seq = kl_in_reward(rewards, logps, ref, mask, beta=0.5, kind="k1", per_token=False)
    np.testing.assert_allclose(seq, [0.85, 1.85, 3.0], rtol=1e-6)
    grad = jax.grad(lambda lp: jnp.sum(kl_in_reward(rewards, lp, ref, mask, 0.5)))(logps)
    np.testing.assert_array_equal(grad, np.zeros((3, 3)))
