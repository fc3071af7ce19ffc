"""PPO clip (clip-higher, dual-clip), GSPO, truncated IS and value loss vs hand values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import (
    aggregate_loss,
    clipped_surrogate,
    clipped_value_loss,
    gspo_surrogate,
    truncated_importance_weights,

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.
)

# Each objective runs jitted, as the update runs it: one compile per function, shape and setting instead of
# one per primitive (the settings are static, as a module's config fixes them).
aggregate_loss = jax.jit(aggregate_loss, static_argnames=("mode", "max_completion_length"))
clipped_surrogate = jax.jit(clipped_surrogate, static_argnames=("clip_low", "clip_high", "dual_clip"))
clipped_value_loss = jax.jit(clipped_value_loss, static_argnames=("clip",))
gspo_surrogate = jax.jit(gspo_surrogate, static_argnames=("clip_low", "clip_high"))
truncated_importance_weights = jax.jit(truncated_importance_weights, static_argnames=("cap",))

# Ratios written out; the last token of row 0 is padding with a garbage logp.
RATIOS = np.array([[1.5, 0.5, 1.1, 1.0], [1.5, 0.5, 0.7, 4.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
OLD = jnp.array([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -2.5, -4.0]])
LOGPS = OLD + jnp.log(jnp.asarray(RATIOS, jnp.float32))
LOGPS = LOGPS.at[0, 3].set(1e4)
ADV = jnp.array([1.0, -2.0])


def test_clip_higher_by_hand():
    loss, info = clipped_surrogate(LOGPS, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28)
    # row 0 (A=+1): -min(r, clip(r, .8, 1.28)); row 1 (A=-2): -min(-2r, -2 clip(r)).
    expected = [[-1.28, -0.5, -1.1, 0.0], [3.0, 1.6, 1.6, 8.0]]
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_array_equal(
        info["clipped"], [[True, False, False, False], [False, True, True, False]]
    )
    np.testing.assert_allclose(np.asarray(info["ratio"])[np.asarray(MASK)],
                               RATIOS[np.asarray(MASK)], rtol=1e-5)


def test_clip_higher_is_asymmetric():
    old = jnp.zeros((1, 2))
    logps = jnp.log(jnp.array([[1.25, 0.75]]))
    mask = jnp.ones((1, 2), bool)
    pos, _ = clipped_surrogate(logps, old, jnp.array([1.0]), mask, clip_low=0.2, clip_high=0.28)
    sym, _ = clipped_surrogate(logps, old, jnp.array([1.0]), mask, clip_low=0.2, clip_high=0.2)
    # ratio 1.25 with A > 0 is inside the higher clip (1.28) but clipped at 1.2.
    np.testing.assert_allclose(pos[0, 0], -1.25, rtol=1e-6)
    np.testing.assert_allclose(sym[0, 0], -1.2, rtol=1e-6)
    neg_hi, _ = clipped_surrogate(logps, old, jnp.array([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    neg_sym, _ = clipped_surrogate(logps, old, jnp.array([-1.0]), mask, clip_low=0.2, clip_high=0.2)
    # ratio .75 with A < 0 is clipped at 1 - clip_low either way: loss .8.
    np.testing.assert_allclose([neg_hi[0, 1], neg_sym[0, 1]], [0.8, 0.8], rtol=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    loss, info = clipped_surrogate(LOGPS, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28,
                                   dual_clip=3.0)
    # row 1 is bounded by -c A = 6: the ratio-4 token's 8 becomes 6; row 0 (A > 0) unchanged.
    np.testing.assert_allclose(loss, [[-1.28, -0.5, -1.1, 0.0], [3.0, 1.6, 1.6, 6.0]],
                               rtol=1e-5)
    np.testing.assert_array_equal(info["dual_clipped"],
                                  [[False] * 4, [False, False, False, True]])
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(LOGPS, OLD, ADV, MASK, dual_clip=0.5)


def test_surrogate_gradient_and_padding_safety():
    def total(logps):
        loss, _ = clipped_surrogate(logps, OLD, ADV, MASK, clip_low=0.2, clip_high=0.28,
                                    dual_clip=3.0)
        return jnp.sum(loss)

    grad = jax.grad(total)(LOGPS)
    # d(-r A)/dlogp = -A r on unclipped tokens; clipped, dual-clipped and padding tokens: 0.
    expected = [[0.0, -0.5, -1.1, 0.0], [3.0, 0.0, 0.0, 0.0]]
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(grad))


def test_importance_weights_scale_loss_and_token_advantages():
    weights = jnp.array([[0.5, 2.0, 1.0, 0.0], [1.0, 1.0, 0.25, 1.0]])
    token_adv = jnp.broadcast_to(ADV[:, None], (2, 4))
    loss, _ = clipped_surrogate(LOGPS, OLD, token_adv, MASK, clip_low=0.2, clip_high=0.28,
                                importance_weights=weights)
    np.testing.assert_allclose(loss, [[-0.64, -1.0, -1.1, 0.0], [3.0, 1.6, 0.4, 8.0]],
                               rtol=1e-5)


def test_truncated_importance_weights():
    old = jnp.array([[np.log(0.5), np.log(3.0), 0.0, 50.0]])
    behaviour = jnp.zeros((1, 4))
    mask = jnp.array([[1, 1, 1, 0]], bool)
    weights = truncated_importance_weights(old, behaviour, mask, cap=2.0)
    np.testing.assert_allclose(weights, [[0.5, 2.0, 1.0, 0.0]], rtol=1e-6)
    grad = jax.grad(lambda o: jnp.sum(truncated_importance_weights(o, behaviour, mask, 2.0)))(old)
    np.testing.assert_array_equal(grad, np.zeros((1, 4)))


GS_MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
GS_OLD = jnp.array([[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.3, 0.0, 0.0]])
GS_DELTA = jnp.array([[0.3, -0.1, 0.4, 7.0], [-0.2, 0.1, 9.0, 9.0]])


def test_gspo_ratio_is_exp_mean_log_ratio():
    loss, info = gspo_surrogate(GS_OLD + GS_DELTA, GS_OLD, jnp.array([1.0, -1.0]), GS_MASK,
                                clip_low=1.0, clip_high=1.0)
    s = np.exp([(0.3 - 0.1 + 0.4) / 3, (-0.2 + 0.1) / 2])
    np.testing.assert_allclose(info["seq_ratio"], s, rtol=1e-6)
    np.testing.assert_allclose(
        loss, [[-s[0]] * 3 + [0.0], [s[1], s[1], 0.0, 0.0]], rtol=1e-6
    )


def test_gspo_clipping_uses_sequence_ratio():
    # s_0 = exp(.2) = 1.221 > 1 + 4e-4 with A > 0: clipped, loss -(1 + 4e-4), no gradient.
    loss, info = gspo_surrogate(GS_OLD + GS_DELTA, GS_OLD, jnp.array([1.0, -1.0]), GS_MASK)
    np.testing.assert_allclose(loss[0, :3], -(1 + 4e-4), rtol=1e-6)
    assert bool(info["clipped"][0, :3].all())
    # s_1 = exp(-.05) < 1 - 3e-4 with A < 0: clipped to 1 - 3e-4.
    np.testing.assert_allclose(loss[1, :2], 1 - 3e-4, rtol=1e-6)


def test_gspo_gradient_equals_sequence_objective():
    adv = jnp.array([1.0, -1.0])

    def token_form(logps):
        loss, _ = gspo_surrogate(logps, GS_OLD, adv, GS_MASK, clip_low=0.1, clip_high=0.1)
        return aggregate_loss(loss, GS_MASK, "seq-mean-token-mean",
                              num_tokens_total=5, num_samples_total=2)

    def sequence_form(logps):
        # GSPO Eq. 7 written directly on sequences, independent of the token form.
        m = GS_MASK.astype(jnp.float32)
        s = jnp.exp(jnp.sum((logps - GS_OLD) * m, axis=1) / jnp.sum(m, axis=1))
        j = jnp.minimum(s * adv, jnp.clip(s, 0.9, 1.1) * adv)
        return -jnp.mean(j)

    logps = GS_OLD + GS_DELTA * GS_MASK
    np.testing.assert_allclose(token_form(logps), sequence_form(logps), rtol=1e-6)
    grad = jax.grad(token_form)(logps)
    np.testing.assert_allclose(grad, jax.grad(sequence_form)(logps), rtol=1e-5, atol=1e-7)
    # Hand: row 1 is unclipped (s = .951 > .9): d/dlogp_t = -A s / (L * N) = s / 4.
    s1 = np.exp(-0.05)
    np.testing.assert_allclose(grad[1], [s1 / 4, s1 / 4, 0, 0], rtol=1e-5)
    # Row 0 is clipped (s = 1.221 > 1.1, A > 0): no gradient.
    np.testing.assert_allclose(grad[0], np.zeros(4), atol=1e-7)


def test_clipped_value_loss_by_hand():
    values = jnp.array([[1.0, 2.0, 0.5, 1.5]])
    old = jnp.array([[0.8, 1.0, 0.5, 1.0]])
    returns = jnp.array([[2.0, 0.0, 1.0, 2.0]])
    mask = jnp.ones((1, 4), bool)
    loss, info = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # last token: clipped value 1.2 -> (1.2-2)^2 = .64 beats (1.5-2)^2 = .25.
    np.testing.assert_allclose(loss, [[0.5, 2.0, 0.125, 0.32]], rtol=1e-6)
    np.testing.assert_array_equal(info["clipped"], [[False, False, False, True]])
    grad = jax.grad(lambda v: jnp.sum(clipped_value_loss(v, old, returns, mask, 0.2)[0]))(values)
    # unclipped: d .5 (v-R)^2 = v - R; clipped token: 0.
    np.testing.assert_allclose(grad, [[-1.0, 2.0, -0.5, 0.0]], rtol=1e-6)


def test_value_clip_frac_counts_only_values_that_moved_past_the_clip():
    """old + clip(V - old) can be one ulp off V; such a token is not clipped (issue: ~0.6 % were)."""
    rng = np.random.default_rng(0)
    shape = (64, 512)
    old = rng.normal(size=shape).astype(np.float32) * 3
    returns = rng.normal(size=shape).astype(np.float32) * 3
    mask = jnp.ones(shape, bool)
    inside = (old + rng.uniform(-0.19, 0.19, size=shape)).astype(np.float32)
    loss, info = clipped_value_loss(inside, old, returns, mask, clip=0.2)
    assert int(np.count_nonzero(info["clipped"])) == 0
    np.testing.assert_allclose(loss, 0.5 * (inside.astype(np.float64) - returns) ** 2, rtol=1e-6)
    # Values that moved further: clipped exactly where float64 says the clipped error is larger.
    moved = (old + rng.uniform(-0.6, 0.6, size=shape)).astype(np.float32)
    _, info = clipped_value_loss(moved, old, returns, mask, clip=0.2)
    v, o, r = (x.astype(np.float64) for x in (moved, old, returns))
    outside = np.abs(v - o) > 0.2
    expected = outside & ((o + np.clip(v - o, -0.2, 0.2) - r) ** 2 > (v - r) ** 2)
    assert expected.sum() > 1000
    np.testing.assert_array_equal(info["clipped"], expected)


def test_shape_mismatch_names_field():
    with pytest.raises(ValueError, match="old_logps"):
        clipped_surrogate(LOGPS, OLD[:, :2], ADV, MASK)
