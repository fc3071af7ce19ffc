"""GMPO with rollout-correction weights: their geometric mean over the row's pooled tokens
multiplies the sequence ratio (float64 reference here), and hostile weights stay finite."""

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.algorithms import gmpo_surrogate
from float_tolerance import EPS32

# Float32 against float64: a log-ratio, a clip, a mean over <= 4 terms, exp, log, products of
# order-1 values: ~10 roundings, 64 ulps with margin (the arithmetic-mean fault moves it by > 1e-2).
RTOL = 64 * EPS32

MASK_NP = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
OLD = jnp.array([[-1.0, -2.0, -0.5, -1.5], [-0.3, -0.9, 0.0, 0.0]])
LR = np.array([[0.1, -0.2, 0.05, 0.3], [-0.1, 0.2, 0.0, 0.0]])
LOGPS = OLD + jnp.asarray(LR, jnp.float32)
ADV = jnp.array([1.0, -2.0])
W = np.array([[0.5, 2.0, 1.0, 1.5], [3.0, 0.25, 0.0, 0.0]], np.float32)


def test_weights_enter_as_their_geometric_mean():
    loss, info = gmpo_surrogate(LOGPS, OLD, ADV, jnp.asarray(MASK_NP), importance_weights=jnp.asarray(W))
    lr = np.asarray(LOGPS, np.float64) - np.asarray(OLD, np.float64)
    for i, a in enumerate(np.asarray(ADV, np.float64)):
        m = MASK_NP[i]
        sign = np.sign(a)
        c = sign * np.minimum(sign * lr[i, m], sign * np.clip(lr[i, m], -0.4, 0.4))
        g = np.prod(W[i, m].astype(np.float64)) ** (1 / m.sum())
        np.testing.assert_allclose(loss[i, m], -a * np.exp(c.mean()) * g, rtol=RTOL)
        np.testing.assert_allclose(info["seq_weight"][i], g, rtol=RTOL)
        assert abs(g - W[i, m].mean()) > 0.1  # not the arithmetic mean
    # The gradient: d(-A s G)/dlogp_t = -A s G / |o| on every unclipped token; weights carry none.
    grad = jax.grad(lambda x: jnp.sum(gmpo_surrogate(x, OLD, ADV, jnp.asarray(MASK_NP),
                                                     importance_weights=jnp.asarray(W))[0]))(LOGPS)
    s_g = np.asarray(info["seq_ratio"], np.float64) * np.asarray(info["seq_weight"], np.float64)
    want = np.where(MASK_NP, -np.asarray(ADV)[:, None] * s_g[:, None], 0.0)  # per token: |o| copies / |o|
    np.testing.assert_allclose(grad, want, rtol=RTOL)


def test_hostile_weights_stay_finite():
    # A pooled token whose weight underflowed to 0 zeroes its row (log 0 = -inf, no NaN); padding's
    # weights (here 1e30 and NaN) are never read.
    w = np.array([[0.0, 2.0, 1.0, 1.5], [3.0, 0.25, 1e30, np.nan]], np.float32)
    run = lambda x: gmpo_surrogate(x, OLD, ADV, jnp.asarray(MASK_NP), importance_weights=jnp.asarray(w))  # noqa: E731
    loss, info = run(LOGPS)
    grad = jax.grad(lambda x: jnp.sum(run(x)[0]))(LOGPS)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    np.testing.assert_array_equal(loss[0], np.zeros(4))
    np.testing.assert_array_equal(grad[0], np.zeros(4))
    np.testing.assert_allclose(info["seq_weight"][1], np.sqrt(0.75), rtol=RTOL)
