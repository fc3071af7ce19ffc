"""Rollout correction (TIS, masked IS, IcePop, rejection) against float64 NumPy written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import clipped_surrogate, rollout_correction, truncated_importance_weights

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.
# atol=1e-37 makes a comparison purely relative: weights as small as exp(-80) must keep their digits.

# rho = pi_old / mu per token. Row 0: padding at the end holds a garbage ratio; row 1 is ragged;
# row 2 is all padding; row 3 is a single token whose ratio 1e30 is far beyond any cap; row 4
# has a log-ratio of 200 (exp overflows float32) and an underflowing one.
LOG_RHO = np.array([
    [np.log(3.0), np.log(0.4), 0.0, 50.0],
    [np.log(1.5), np.log(1.2), np.log(0.8), np.log(1.1)],
    [7.0, -7.0, 0.0, 0.0],
    [np.log(1e30), 0.0, 0.0, 0.0],
    [200.0, -200.0, np.log(0.9), 0.0],
])
MASK_NP = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], bool)
ROLLOUT = jnp.asarray(np.linspace(-3.0, -0.1, LOG_RHO.size).reshape(LOG_RHO.shape), jnp.float32)
OLD = ROLLOUT + jnp.asarray(LOG_RHO, jnp.float32)
MASK = jnp.asarray(MASK_NP)
# The log-ratios the function actually sees (float32 old - rollout), in float64.
LR = np.where(MASK_NP, np.asarray(OLD, np.float64) - np.asarray(ROLLOUT, np.float64), 0.0)


def _level_log_ratio(level):
    if level == "token":
        return LR
    total = LR.sum(axis=1, keepdims=True)
    if level == "geometric":
        total = total / np.maximum(MASK_NP.sum(axis=1, keepdims=True), 1)
    return np.broadcast_to(total, LR.shape)


def _expected(mode, level, cap=2.0, bounds=None):
    lr = _level_log_ratio(level)
    with np.errstate(over="ignore"):
        rho = np.exp(lr)
    if mode == "tis":
        return np.where(MASK_NP, np.minimum(rho, cap), 0.0), MASK_NP
    if mode == "none":
        return MASK_NP.astype(float), MASK_NP
    lo, hi = bounds or ((0.5, 5.0) if mode == "icepop" else (1 / cap, cap))
    keep = MASK_NP & (rho >= lo) & (rho <= hi)
    return np.where(keep, 1.0 if mode == "mask" else rho, 0.0), keep


@pytest.mark.parametrize("mode,level", [
    ("tis", "token"), ("tis", "sequence"), ("tis", "geometric"),
    ("mis", "token"), ("mis", "sequence"), ("mis", "geometric"),
    ("mask", "token"), ("mask", "sequence"), ("icepop", "token"), ("none", "token"),
])
def test_weights_and_keep_mask_by_hand(mode, level):
    weights, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode=mode, level=level, cap=2.0)
    expected_w, expected_keep = _expected(mode, level)
    np.testing.assert_array_equal(keep, expected_keep)
    # atol: e^-200 underflows float32 to 0.
    np.testing.assert_allclose(weights, expected_w, rtol=1e-5, atol=1e-37)
    assert np.all(np.isfinite(weights))


def test_hand_values_spelled_out():
    # Row 1, ratios 1.5, 1.2, .8, 1.1: the product is 1.584, the geometric mean 1.584 ** .25.
    w, _, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level="sequence", cap=2.0)
    np.testing.assert_allclose(w[1], [1.584] * 4, rtol=1e-5)
    w, _, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level="geometric", cap=2.0)
    np.testing.assert_allclose(w[1], [1.584 ** 0.25] * 4, rtol=1e-5)
    # Token TIS: 3 -> 2, .4 stays, 1 stays, padding 0; 1e30 -> exactly the cap.
    w, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", cap=2.0)
    np.testing.assert_allclose(w[0], [2.0, 0.4, 1.0, 0.0], rtol=1e-5)
    assert float(w[3, 0]) == 2.0 and float(w[4, 0]) == 2.0 and float(w[4, 1]) == 0.0
    # Token MIS on [1/2, 2]: 3 and .4 dropped, the kept weigh their ratio.
    w, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", cap=2.0)
    np.testing.assert_array_equal(keep[0], [False, False, True, False])
    np.testing.assert_allclose(w[1], [1.5, 1.2, 0.8, 1.1], rtol=1e-5)
    # Sequence MIS: row 0's product 1.2 is inside [1/2, 2]: the whole row is kept, ratio 1.2.
    w, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", level="sequence", cap=2.0)
    np.testing.assert_array_equal(keep[0], [True, True, True, False])
    np.testing.assert_allclose(w[0, :3], [1.2] * 3, rtol=1e-5)
    # IcePop [.5, 5]: 3 kept (IcePop's beta is 5), .4 dropped.
    w, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="icepop")
    np.testing.assert_array_equal(keep[0], [True, False, True, False])
    np.testing.assert_allclose(w[0], [3.0, 0.0, 1.0, 0.0], rtol=1e-5)


def test_explicit_bounds():
    w, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="mask", bounds=(0.85, 1.3))
    expected_w, expected_keep = _expected("mask", "token", bounds=(0.85, 1.3))
    np.testing.assert_array_equal(keep, expected_keep)
    np.testing.assert_array_equal(keep[1], [False, True, False, True])
    np.testing.assert_array_equal(w, expected_w)


def test_metrics_by_hand():
    _, _, m = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", cap=2.0)
    valid = MASK_NP
    lr = LR[valid]
    b = np.clip(lr, -20, 20)
    np.testing.assert_allclose(m["rollout_corr/kl_k1"], np.mean(-lr), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/kl_k3"], np.mean(np.expm1(b) - b), rtol=1e-5)
    w, keep = _expected("mis", "token")
    np.testing.assert_allclose(m["rollout_corr/is_weight_mean"], w[keep].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/is_weight_max"], w[keep].max(), rtol=1e-5)
    # 11 valid tokens; dropped: 3, .4 (row 0), 1e30 (row 3), e^200, e^-200 (row 4) -> 5 / 11.
    np.testing.assert_allclose(m["rollout_corr/token_masked_frac"], 5 / 11, rtol=1e-6)
    # Rows with a valid token: 0, 1, 3, 4; with a dropped token: 0, 3, 4 -> 3 / 4 (row 2 is empty).
    np.testing.assert_allclose(m["rollout_corr/seq_masked_frac"], 0.75, rtol=1e-6)
    for value in m.values():
        assert value.shape == () and np.isfinite(value)


def test_identical_logps_change_nothing_bitwise():
    rng = np.random.default_rng(0)
    logps = jnp.asarray(rng.normal(size=(3, 5)) - 2.0, jnp.float32)
    mask = jnp.asarray(np.arange(5)[None, :] < np.array([5, 2, 1])[:, None])
    current = logps + jnp.asarray(rng.normal(size=(3, 5)) * 0.3, jnp.float32)
    adv = jnp.array([1.0, -0.5, 2.0])
    plain, _ = clipped_surrogate(current, logps, adv, mask, clip_high=0.28)
    grad_plain = jax.grad(lambda x: jnp.sum(clipped_surrogate(x, logps, adv, mask, clip_high=0.28)[0]))(current)
    for mode in ("tis", "mis", "mask", "icepop", "none"):
        for level in (("token",) if mode == "icepop" else ("token", "sequence", "geometric")):
            weights, keep, m = rollout_correction(logps, logps, mask, mode=mode, level=level)
            np.testing.assert_array_equal(weights, np.asarray(mask, np.float32))
            np.testing.assert_array_equal(keep, mask)
            assert float(m["rollout_corr/kl_k1"]) == 0.0 and float(m["rollout_corr/kl_k3"]) == 0.0
            assert float(m["rollout_corr/token_masked_frac"]) == 0.0
            assert float(m["rollout_corr/seq_masked_frac"]) == 0.0
            assert float(m["rollout_corr/is_weight_mean"]) == 1.0

            def corrected(x):
                return clipped_surrogate(x, logps, adv, keep, clip_high=0.28, importance_weights=weights)[0]

            np.testing.assert_array_equal(corrected(current), plain)
            np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(corrected(x)))(current), grad_plain)


def test_weights_carry_no_gradient_and_jit_matches():
    def total(old):
        return jnp.sum(rollout_correction(old, ROLLOUT, MASK, mode="mis", level="geometric")[0])

    np.testing.assert_array_equal(jax.grad(total)(OLD), np.zeros(LR.shape))
    eager = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", level="sequence")
    jitted = jax.jit(lambda o, r, m: rollout_correction(o, r, m, mode="tis", level="sequence"))(OLD, ROLLOUT, MASK)
    for e, j in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(j, e, rtol=1e-6)


def test_truncated_importance_weights_keeps_its_name_and_values():
    w = truncated_importance_weights(OLD, ROLLOUT, MASK, cap=2.0)
    np.testing.assert_allclose(w, _expected("tis", "token")[0], rtol=1e-5, atol=1e-37)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="mode="):
        rollout_correction(OLD, ROLLOUT, MASK, mode="clip")
    with pytest.raises(ValueError, match="level="):
        rollout_correction(OLD, ROLLOUT, MASK, level="batch")
    with pytest.raises(ValueError, match="icepop"):
        rollout_correction(OLD, ROLLOUT, MASK, mode="icepop", level="sequence")
    with pytest.raises(ValueError, match="cap="):
        rollout_correction(OLD, ROLLOUT, MASK, mode="mis", cap=0.5)
    with pytest.raises(ValueError, match="bounds="):
        rollout_correction(OLD, ROLLOUT, MASK, mode="mis", bounds=(1.2, 2.0))
    with pytest.raises(ValueError, match="bounds="):
        rollout_correction(OLD, ROLLOUT, MASK, mode="tis", bounds=(0.5, 2.0))
    with pytest.raises(ValueError, match="rollout_logps"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK)
