"""CISPO, SAPO and GMPO against the papers' formulas written in float64 NumPy here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import (
    aggregate_loss,
    cispo_surrogate,
    clipped_surrogate,
    gmpo_surrogate,
    sapo_surrogate,

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.
)

# Each objective runs jitted, as the update runs it: one compile per function, shape and setting instead of
# one per primitive (the settings are static, as a module's config fixes them).
aggregate_loss = jax.jit(aggregate_loss, static_argnames=("mode", "max_completion_length"))
cispo_surrogate = jax.jit(cispo_surrogate, static_argnames=("clip_low", "clip_high"))
clipped_surrogate = jax.jit(clipped_surrogate, static_argnames=("clip_low", "clip_high", "dual_clip"))
gmpo_surrogate = jax.jit(gmpo_surrogate, static_argnames=("clip_low", "clip_high"))
sapo_surrogate = jax.jit(sapo_surrogate, static_argnames=("tau_pos", "tau_neg"))

# Ratios written out; row 0's last token is padding with a garbage logp.
RATIOS = np.array([[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 0.7, 4.0]])
MASK_NP = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
MASK = jnp.asarray(MASK_NP)
OLD = jnp.array([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -2.5, -4.0]])
LOGPS = (OLD + jnp.log(jnp.asarray(RATIOS, jnp.float32))).at[0, 3].set(1e4)
ADV = jnp.array([1.0, -2.0])
A_TOK = np.array([[1.0] * 4, [-2.0] * 4])
# The ratios as float32 computes them, in float64.
R = np.exp(np.where(MASK_NP, np.asarray(LOGPS, np.float64) - np.asarray(OLD, np.float64), 0.0))


def _grad(fn, logps=LOGPS, **kw):
    return jax.grad(lambda x: jnp.sum(fn(x, OLD, ADV, MASK, **kw)[0]))(logps)


# ---------------------------------------------------------------- CISPO


def test_cispo_by_hand():
    loss, info = cispo_surrogate(LOGPS, OLD, ADV, MASK, clip_high=0.28)
    # No lower bound by default: row 0 (A=1): weights 1.28, .5, 1.1; row 1 (A=-2): 1.28, .5, .7, 1.28.
    np.testing.assert_allclose(loss, [[-1.28, -0.5, -1.1, 0.0], [2.56, 1.0, 1.4, 2.56]], rtol=1e-5)
    np.testing.assert_array_equal(info["clipped"], [[True, False, False, False], [True, False, False, True]])
    # The value is exactly -A * r_hat (the log pi factor of the paper's form only shapes the gradient).
    want = np.where(MASK_NP, -(np.asarray(A_TOK, np.float32) * np.asarray(info["weight"])), 0.0)
    np.testing.assert_array_equal(loss, want)
    loss, _ = cispo_surrogate(LOGPS, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28)
    np.testing.assert_allclose(loss[:, 1], [-0.8, 1.6], rtol=1e-5)


def test_cispo_keeps_gradient_where_ppo_clips():
    """The point of CISPO: a token outside the clip range still learns (PPO's gradient is 0)."""
    kw = dict(clip_low=0.2, clip_high=0.28)
    cispo = _grad(cispo_surrogate, **kw)
    ppo = _grad(clipped_surrogate, **kw)
    w = np.where(MASK_NP, np.clip(R, 0.8, 1.28), 0.0)
    # d/dlogp [-sg(w) A log pi] = -w A on every valid token.
    np.testing.assert_allclose(cispo, -w * A_TOK, rtol=1e-5)
    # Tokens PPO clips: (0, 0) r=1.5 A>0, (1, 1) r=.5 A<0, (1, 2) r=.7 A<0.
    for i, j in [(0, 0), (1, 1), (1, 2)]:
        assert float(ppo[i, j]) == 0.0 and abs(float(cispo[i, j])) > 0.5
    np.testing.assert_allclose(cispo[0], [-1.28, -0.8, -1.1, 0.0], rtol=1e-5)
    np.testing.assert_allclose(ppo[0], [0.0, -0.5, -1.1, 0.0], rtol=1e-5, atol=1e-7)


def test_cispo_extreme_ratios_and_zero_advantage():
    old = jnp.zeros((1, 3))
    logps = jnp.array([[np.log(1e30), 200.0, -200.0]])
    mask = jnp.ones((1, 3), bool)
    loss, _ = cispo_surrogate(logps, old, jnp.array([-1.0]), mask, clip_high=4.0)
    np.testing.assert_allclose(loss, [[5.0, 5.0, 0.0]], atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(cispo_surrogate(x, old, jnp.array([-1.0]), mask)[0]))(logps)
    np.testing.assert_allclose(grad, [[5.0, 5.0, 0.0]], atol=1e-6)
    zero_grad = jax.grad(lambda x: jnp.sum(cispo_surrogate(x, old, jnp.array([0.0]), mask)[0]))(logps)
    np.testing.assert_array_equal(zero_grad, np.zeros((1, 3)))
    with pytest.raises(ValueError, match="clip_low"):
        cispo_surrogate(logps, old, jnp.array([0.0]), mask, clip_low=1.5)


# ---------------------------------------------------------------- SAPO


def _sapo_np(r, a, tau_pos, tau_neg):
    tau = np.where(a > 0, tau_pos, tau_neg)
    s = 1 / (1 + np.exp(-tau * (r - 1)))
    return -(4 / tau) * s * a, -4 * s * (1 - s) * r * a  # loss, d loss / d logp


def test_sapo_value_and_gradient_by_hand():
    adv = np.array([[1.0, -1.0, 2.0, 5.0], [-2.0, 0.5, 0.0, -1.0]])  # token-level, mixed signs
    loss, info = sapo_surrogate(LOGPS, OLD, jnp.asarray(adv, jnp.float32), MASK, tau_pos=1.0, tau_neg=1.05)
    want, want_grad = _sapo_np(R, adv, 1.0, 1.05)
    np.testing.assert_allclose(loss, np.where(MASK_NP, want, 0.0), rtol=1e-5, atol=1e-7)
    grad = jax.grad(lambda x: jnp.sum(sapo_surrogate(x, OLD, jnp.asarray(adv, jnp.float32), MASK)[0]))(LOGPS)
    np.testing.assert_allclose(grad, np.where(MASK_NP, want_grad, 0.0), rtol=1e-5, atol=1e-7)
    assert not np.any(info["clipped"])


def test_sapo_is_plain_policy_gradient_on_policy_and_asymmetric():
    old = jnp.zeros((2, 1))
    mask = jnp.ones((2, 1), bool)
    adv = jnp.array([1.5, -1.5])
    grad = jax.grad(lambda x: jnp.sum(sapo_surrogate(x, old, adv, mask, tau_pos=1.0, tau_neg=3.0)[0]))(old)
    # r = 1: w = 4 * .5 * .5 = 1, so the gradient is -A, whatever tau.
    np.testing.assert_allclose(grad, [[-1.5], [1.5]], rtol=1e-6)
    # Same ratio 2, opposite signs: the negative side (tau 3) is damped more than the positive.
    logps = jnp.log(jnp.array([[2.0], [2.0]]))
    grad = jax.grad(lambda x: jnp.sum(sapo_surrogate(x, old, adv, mask, tau_pos=1.0, tau_neg=3.0)[0]))(logps)
    _, want_pos = _sapo_np(2.0, 1.5, 1.0, 3.0)
    _, want_neg = _sapo_np(2.0, -1.5, 1.0, 3.0)
    np.testing.assert_allclose(grad[:, 0], [want_pos, want_neg], rtol=1e-5)
    assert abs(want_neg) < abs(want_pos)


def test_sapo_extreme_ratios_stay_finite():
    old = jnp.zeros((1, 3))
    logps = jnp.array([[np.log(1e30), 200.0, -200.0]])
    mask = jnp.ones((1, 3), bool)
    loss, _ = sapo_surrogate(logps, old, jnp.array([1.0]), mask)
    grad = jax.grad(lambda x: jnp.sum(sapo_surrogate(x, old, jnp.array([1.0]), mask)[0]))(logps)
    # Saturated gate: loss -4/tau, no gradient; r -> 0: loss -(4) sigmoid(-1), gradient ~ 0.
    np.testing.assert_allclose(loss, [[-4.0, -4.0, -4 / (1 + np.e)]], rtol=1e-5)
    assert np.all(np.isfinite(grad)) and np.all(np.abs(grad) < 1e-6)
    with pytest.raises(ValueError, match="tau_pos"):
        sapo_surrogate(logps, old, jnp.array([1.0]), mask, tau_pos=0.0)


# ---------------------------------------------------------------- GMPO

GM_MASK_NP = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], bool)
GM_MASK = jnp.asarray(GM_MASK_NP)
GM_OLD = jnp.array([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.3, 0.0, 0.0], [-0.7, 0.0, 0.0, 0.0],
                    [-1.0, -1.0, 0.0, 0.0]])
GM_LR = np.array([[0.5, -0.1, 0.2, 9.0], [-0.6, 0.3, 9.0, 9.0], [0.1, 0.0, 0.0, 0.0], [0.3, -0.2, 0.0, 0.0]])
GM_ADV = jnp.array([1.0, -1.0, 2.0, 0.0])


def _gmpo_paper(lr, adv, mask, eps):
    """GMPO Eq. 4 as written: sgn(A) prod_t |min(r A, clip(r, e^-eps, e^eps) A)|^(1/|o|)."""
    out = []
    for row_lr, a, m in zip(lr, adv, mask):
        r = np.exp(row_lr[m])
        terms = np.abs(np.minimum(r * a, np.clip(r, np.exp(-eps), np.exp(eps)) * a))
        out.append(np.sign(a) * np.prod(terms) ** (1 / m.sum()) if a != 0 else 0.0)
    return np.array(out)


def test_gmpo_matches_the_paper_objective():
    logps = GM_OLD + jnp.asarray(GM_LR, jnp.float32)
    loss, info = gmpo_surrogate(logps, GM_OLD, GM_ADV, GM_MASK)
    lr = np.asarray(logps, np.float64) - np.asarray(GM_OLD, np.float64)
    j = _gmpo_paper(lr, np.asarray(GM_ADV), GM_MASK_NP, 0.4)
    total = aggregate_loss(loss, GM_MASK, "seq-mean-token-mean", num_tokens_total=8, num_samples_total=4)
    np.testing.assert_allclose(total, -j.mean(), rtol=1e-5)
    # By hand: row 0 (A > 0) clips .5 to .4 -> s = exp(.5 / 3); row 1 (A < 0) clips -.6 to -.4
    # -> s = exp(-.1 / 2); row 2 is a single token, s = exp(.1); row 3 has A = 0: loss 0.
    s = np.exp([0.5 / 3, -0.1 / 2, 0.1])
    np.testing.assert_allclose(info["seq_ratio"][:3], s, rtol=1e-5)
    np.testing.assert_allclose(loss[0], [-s[0]] * 3 + [0.0], rtol=1e-5)
    np.testing.assert_allclose(loss[1], [s[1], s[1], 0.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(loss[2], [-2 * s[2], 0.0, 0.0, 0.0], rtol=1e-5)
    np.testing.assert_array_equal(loss[3], np.zeros(4))
    np.testing.assert_array_equal(info["clipped"], [[True, False, False, False], [True, False, False, False],
                                                    [False] * 4, [False] * 4])


def test_gmpo_gradient_by_hand():
    logps = GM_OLD + jnp.asarray(GM_LR, jnp.float32)

    def total(x):
        loss, _ = gmpo_surrogate(x, GM_OLD, GM_ADV, GM_MASK)
        return aggregate_loss(loss, GM_MASK, "seq-mean-token-mean", num_tokens_total=8, num_samples_total=4)

    grad = jax.grad(total)(logps)
    # d(-A s) / d logp_t = -A s / |o| on unclipped tokens, over N = 4 sequences.
    s = np.exp([0.5 / 3, -0.1 / 2, 0.1])
    want = np.zeros((4, 4))
    want[0, 1:3] = -s[0] / 3 / 4
    want[1, 1] = s[1] / 2 / 4
    want[2, 0] = -2 * s[2] / 4
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_gmpo_token_advantages_are_row_means_and_extremes_are_finite():
    logps = GM_OLD + jnp.asarray(GM_LR, jnp.float32)
    token_adv = jnp.asarray(np.where(GM_MASK_NP, np.array([[0.5, 1.5, 1.0, 7.0]] * 4)
                                     * np.asarray(GM_ADV)[:, None], 99.0), jnp.float32)
    # Row 0's token advantages .5, 1.5, 1 average to 1 = GM_ADV[0] (padding's 99 ignored).
    loss_tok, _ = gmpo_surrogate(logps, GM_OLD, token_adv, GM_MASK)
    loss_seq, _ = gmpo_surrogate(logps, GM_OLD, GM_ADV, GM_MASK)
    np.testing.assert_allclose(loss_tok[0], loss_seq[0], rtol=1e-6)
    # A < 0 and a ratio of e^200 (the unclipped side): clamped to e^20 per token, finite.
    old = jnp.zeros((1, 2))
    huge = jnp.array([[200.0, 0.0]])
    mask = jnp.ones((1, 2), bool)
    loss, info = gmpo_surrogate(huge, old, jnp.array([-1.0]), mask)
    np.testing.assert_allclose(info["seq_ratio"], [np.exp(10.0)], rtol=1e-5)
    grad = jax.grad(lambda x: jnp.sum(gmpo_surrogate(x, old, jnp.array([-1.0]), mask)[0]))(huge)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
