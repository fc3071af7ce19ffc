"""On-policy distillation: reverse-KL advantages by hand, zero when teacher == student, exact gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import distillation_loss, reverse_kl_advantages

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.

MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
STUDENT = jnp.array([[-1.0, -2.0, -0.5, 9.0], [-0.2, -3.0, 0.0, 0.0]])
TEACHER = jnp.array([[-1.5, -1.0, -0.5, -9.0], [-0.1, -1.0, 0.0, 0.0]])


def test_reverse_kl_advantages_by_hand():
    adv, kl = reverse_kl_advantages(STUDENT, TEACHER, MASK, kl_coef=0.5)
    # d = student - teacher: [.5, -1, 0 | -.1, -2]; A = -.5 d; padding 0.
    np.testing.assert_allclose(kl, [[0.5, -1.0, 0.0, 0.0], [-0.1, -2.0, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(adv, [[-0.25, 0.5, 0.0, 0.0], [0.05, 1.0, 0.0, 0.0]], rtol=1e-6)
    # Mixed with a task reward's sequence advantages [2, -1] at weight 3.
    adv, _ = reverse_kl_advantages(STUDENT, TEACHER, MASK, kl_coef=0.5, task_advantages=jnp.array([2.0, -1.0]),
                                   task_coef=3.0)
    np.testing.assert_allclose(adv, [[5.75, 6.5, 6.0, 0.0], [-2.95, -2.0, 0.0, 0.0]], rtol=1e-6)


def test_teacher_equal_to_student_gives_zero_loss_and_gradient():
    for logps in (STUDENT, STUDENT + jnp.array([[0.3, -0.2, 69.0, 0.0], [-200.0, 0.1, 0.0, 0.0]])):
        def total(x):
            return jnp.sum(distillation_loss(x, STUDENT, STUDENT, MASK)[0])

        loss, info = distillation_loss(logps, STUDENT, STUDENT, MASK)
        np.testing.assert_array_equal(loss, np.zeros((2, 4)))
        np.testing.assert_array_equal(jax.grad(total)(logps), np.zeros((2, 4)))
        np.testing.assert_array_equal(info["reverse_kl"], np.zeros((2, 4)))


def test_loss_values_and_gradient_by_hand():
    loss, _ = distillation_loss(STUDENT, STUDENT, TEACHER, MASK, kl_coef=2.0)
    d = np.array([[0.5, -1.0, 0.0, 0.0], [-0.1, -2.0, 0.0, 0.0]])
    np.testing.assert_allclose(loss, 2.0 * d, rtol=1e-6)  # -r A with r = 1, A = -2 d
    grad = jax.grad(lambda x: jnp.sum(distillation_loss(x, STUDENT, TEACHER, MASK, kl_coef=2.0)[0]))(STUDENT)
    np.testing.assert_allclose(grad, 2.0 * d, rtol=1e-6)


def test_expected_gradient_is_the_exact_reverse_kl_gradient():
    """Summing the per-token loss over every vocabulary item weighted by pi_s gives grad KL(pi_s || pi_t)."""
    rng = np.random.default_rng(0)
    vocab = 6
    z = rng.normal(size=vocab)
    teacher = np.log(rng.dirichlet(np.ones(vocab)))
    mask = jnp.ones((vocab, 1), bool)

    def expected_loss(logits):
        logp = jax.nn.log_softmax(logits)  # one row per vocabulary item y, its token y
        sampled = logp[:, None]
        loss, _ = distillation_loss(sampled, jax.lax.stop_gradient(sampled), jnp.asarray(teacher[:, None], jnp.float32), mask)
        return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * loss[:, 0])

    grad = jax.grad(expected_loss)(jnp.asarray(z, jnp.float32))
    p = np.exp(z - np.log(np.sum(np.exp(z))))
    kl = np.sum(p * (np.log(p) - teacher))
    np.testing.assert_allclose(grad, p * (np.log(p) - teacher - kl), rtol=1e-4, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kl_coef"):
        reverse_kl_advantages(STUDENT, TEACHER, MASK, kl_coef=-1.0)
    with pytest.raises(ValueError, match="teacher_logps"):
        reverse_kl_advantages(STUDENT, TEACHER[:, :2], MASK)
