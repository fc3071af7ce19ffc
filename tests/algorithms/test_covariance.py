"""Clip-Cov and KL-Cov: the covariance, the tokens each rule picks, and their losses, by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import (
    clip_cov_select,
    clip_cov_surrogate,
    clipped_surrogate,
    kl_cov_select,
    kl_cov_surrogate,
    token_covariance,

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.
)

LP = np.array([[-0.1, -2.5, -0.3, -9.0, 7.0], [-3.0, -0.2, -4.0, -1.0, -0.5], [-1.0, -0.05, 0.0, 0.0, 0.0]])
MASK_NP = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)
ADV_NP = np.array([3.0, -2.0, 0.5])
MASK = jnp.asarray(MASK_NP)
LOGPS = jnp.asarray(LP, jnp.float32)
ADV = jnp.asarray(ADV_NP, jnp.float32)
# PPO ratios: token (1, 2) has A < 0 and ratio .5, so PPO clips it; the rest are near 1.
RATIOS = np.ones_like(LP)
RATIOS[1, 2] = 0.5
RATIOS[0, 1] = 1.1
OLD = LOGPS - jnp.asarray(np.log(RATIOS), jnp.float32)


def _cov_np():
    lp, a = LP.astype(np.float64), np.broadcast_to(ADV_NP[:, None], LP.shape)
    return np.where(MASK_NP, (lp - lp[MASK_NP].mean()) * (a - a[MASK_NP].mean()), 0.0)


def test_token_covariance_by_hand():
    cov = token_covariance(LOGPS, ADV, MASK)
    np.testing.assert_allclose(cov, _cov_np(), rtol=1e-5, atol=1e-6)
    # Spelled out: mean logp -1.9682, mean A .2727 over the 11 valid tokens.
    np.testing.assert_allclose(cov[0, 0], (-0.1 + 1.96818182) * (3 - 0.27272727), rtol=1e-5)
    grad = jax.grad(lambda x: jnp.sum(token_covariance(x, ADV, MASK)))(LOGPS)
    np.testing.assert_array_equal(grad, np.zeros(LP.shape))


def test_clip_cov_candidates_are_exactly_the_band():
    cov = token_covariance(LOGPS, ADV, MASK)
    key = jax.random.key(0)
    # Ratio 1: every candidate is drawn. Band [1, 5]: 4.55 (0, 2), 2.345 (1, 0), 4.618 (1, 2);
    # 5.095 (0, 0) is just outside.
    chosen = clip_cov_select(cov, MASK, key, select_ratio=1.0, cov_low=1.0, cov_high=5.0)
    band = MASK_NP & (_cov_np() >= 1.0) & (_cov_np() <= 5.0)
    np.testing.assert_array_equal(chosen, band)
    assert sorted(zip(*np.nonzero(band))) == [(0, 2), (1, 0), (1, 2)]
    excluded = np.zeros_like(MASK_NP)
    excluded[1, 2] = True
    chosen = clip_cov_select(cov, MASK, key, select_ratio=1.0, exclude=jnp.asarray(excluded))
    np.testing.assert_array_equal(chosen, band & ~excluded)


def test_clip_cov_draws_max_1_floor_rN_reproducibly_from_the_key():
    cov = token_covariance(LOGPS, ADV, MASK)
    band = MASK_NP & (_cov_np() >= 1.0) & (_cov_np() <= 5.0)
    seen = set()
    for seed in range(8):
        key = jax.random.key(seed)
        # floor(.2 * 11) = 2 of the 3 candidates: those with the smallest uniform draws.
        chosen = np.asarray(clip_cov_select(cov, MASK, key, select_ratio=0.2))
        u = np.asarray(jax.random.uniform(key, LP.shape))
        order = sorted(zip(*np.nonzero(band)), key=lambda ij: u[ij])
        want = np.zeros_like(band)
        for ij in order[:2]:
            want[ij] = True
        np.testing.assert_array_equal(chosen, want)
        np.testing.assert_array_equal(clip_cov_select(cov, MASK, key, select_ratio=0.2), chosen)
        seen.add(tuple(np.flatnonzero(chosen)))
        # A tiny ratio still draws one token (max(1, floor(rN))).
        assert int(np.sum(clip_cov_select(cov, MASK, key, select_ratio=1e-4))) == 1
    assert len(seen) > 1  # the key matters


def test_clip_cov_loss_detaches_only_the_drawn_tokens():
    key = jax.random.key(3)
    kw = dict(clip_low=0.2, clip_high=0.2)
    loss, info = clip_cov_surrogate(LOGPS, OLD, ADV, MASK, key, select_ratio=1.0, **kw)
    ppo, ppo_info = clipped_surrogate(LOGPS, OLD, ADV, MASK, **kw)
    np.testing.assert_array_equal(loss, ppo)  # values unchanged
    # Candidates minus PPO-clipped (1, 2): (0, 2) and (1, 0).
    np.testing.assert_array_equal(np.argwhere(info["cov_detached"]).tolist(), [[0, 2], [1, 0]])
    # `clipped` is what PPO's clip cut (the step's clip_frac), nothing the covariance rule chose.
    np.testing.assert_array_equal(info["clipped"], ppo_info["clipped"])
    assert not np.any(np.asarray(info["clipped"]) & np.asarray(info["cov_detached"]))
    grad = jax.grad(lambda x: jnp.sum(clip_cov_surrogate(x, OLD, ADV, MASK, key, select_ratio=1.0, **kw)[0]))(LOGPS)
    ppo_grad = jax.grad(lambda x: jnp.sum(clipped_surrogate(x, OLD, ADV, MASK, **kw)[0]))(LOGPS)
    want = np.where(np.asarray(info["cov_detached"]), 0.0, ppo_grad)
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    assert float(grad[0, 2]) == 0.0 and float(ppo_grad[0, 2]) != 0.0


def test_kl_cov_picks_the_top_k_and_penalises_them():
    cov = token_covariance(LOGPS, ADV, MASK)
    # floor(.3 * 11) = 3 largest: 5.095 (0, 0), 4.618 (1, 2), 4.55 (0, 2).
    chosen = kl_cov_select(cov, MASK, select_ratio=0.3)
    np.testing.assert_array_equal(np.argwhere(chosen).tolist(), [[0, 0], [0, 2], [1, 2]])
    flat = np.where(MASK_NP, _cov_np(), -np.inf).ravel()
    want = np.zeros(flat.size, bool)
    want[np.argsort(-flat, kind="stable")[:3]] = True
    np.testing.assert_array_equal(np.asarray(chosen).ravel(), want)

    loss, info = kl_cov_surrogate(LOGPS, OLD, ADV, MASK, select_ratio=0.3, kl_coef=2.0)
    a = np.broadcast_to(ADV_NP[:, None], LP.shape)
    lr = np.log(RATIOS)
    want_loss = np.where(MASK_NP, -RATIOS * a + np.where(want.reshape(LP.shape), 2.0 * np.abs(lr), 0.0), 0.0)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    # (1, 2): r = .5, A = -2: -(.5)(-2) + 2 |log .5| = 1 + 1.386.
    np.testing.assert_allclose(loss[1, 2], 1 + 2 * np.log(2), rtol=1e-5)
    grad = jax.grad(lambda x: jnp.sum(kl_cov_surrogate(x, OLD, ADV, MASK, select_ratio=0.3, kl_coef=2.0)[0]))(LOGPS)
    want_grad = np.where(MASK_NP, -RATIOS * a + np.where(want.reshape(LP.shape), 2.0 * np.sign(lr), 0.0), 0.0)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_degenerate_batches():
    key = jax.random.key(0)
    # All advantages equal: every covariance is 0; Clip-Cov's band [1, 5] is empty, KL-Cov still
    # takes max(1, floor(kN)) = 1 token, the first valid one on a tie.
    same = jnp.full((3,), 0.7)
    cov = token_covariance(LOGPS, same, MASK)
    np.testing.assert_array_equal(cov, np.zeros(LP.shape))
    assert not np.any(clip_cov_select(cov, MASK, key, select_ratio=1.0))
    np.testing.assert_array_equal(np.argwhere(kl_cov_select(cov, MASK, select_ratio=0.01)).tolist(), [[0, 0]])
    # One valid token: its covariance is 0 (it is its own mean).
    one = np.zeros_like(MASK_NP)
    one[1, 3] = True
    cov = token_covariance(LOGPS, ADV, jnp.asarray(one))
    np.testing.assert_array_equal(cov, np.zeros(LP.shape))
    np.testing.assert_array_equal(kl_cov_select(cov, jnp.asarray(one), select_ratio=0.5), one)
    # Nothing valid: nothing chosen, zero loss.
    none = jnp.zeros_like(MASK)
    loss, info = kl_cov_surrogate(LOGPS, OLD, ADV, none)
    assert not np.any(info["kl_penalised"]) and not np.any(loss)
    loss, info = clip_cov_surrogate(LOGPS, OLD, ADV, none, key, select_ratio=1.0, cov_low=-1.0)
    assert not np.any(info["cov_detached"]) and not np.any(loss)


def test_jit_and_bad_arguments():
    key = jax.random.key(1)
    fn = lambda x, o, a, m, k: clip_cov_surrogate(x, o, a, m, k, select_ratio=0.2)[0]  # noqa: E731
    np.testing.assert_array_equal(jax.jit(fn)(LOGPS, OLD, ADV, MASK, key), fn(LOGPS, OLD, ADV, MASK, key))
    with pytest.raises(ValueError, match="select_ratio"):
        kl_cov_select(jnp.zeros(LP.shape), MASK, select_ratio=0.0)
    with pytest.raises(ValueError, match="cov_low"):
        clip_cov_select(jnp.zeros(LP.shape), MASK, key, cov_low=5.0, cov_high=1.0)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_cov_surrogate(LOGPS, OLD, ADV, MASK, kl_coef=-1.0)
