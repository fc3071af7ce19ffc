"""Gradient accumulation: summed micro-batch grads equal the mini-batch grad, every mode.

The trainer's contract (see ``rlbolt.algorithms.aggregation``): micro-batch gradients are summed
and every micro batch divides by mini-batch totals.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import LossAggregation, aggregate_loss, clipped_surrogate, kl_penalty

# Tolerances (tests/float_tolerance.py's rule): micro-batch sums against the full batch are two float32
# orders of the same 8 rows x 6 tokens of a 5 x 7 softmax objective: each gradient entry sums <= 48
# terms, so the two differ by <= 48 * eps * sum|terms| (sum_error_bound), ~6e-6 relative: rtol=1e-5.
# The guard at the end uses rtol=1e-3 on purpose: the wrong totals differ by a whole factor.

# A toy differentiable policy: logps = log_softmax(features @ W) gathered at the tokens.
N, C, D, V = 8, 6, 5, 7
_rng = np.random.default_rng(0)
FEATURES = jnp.asarray(_rng.normal(size=(N, C, D)), jnp.float32)
TOKENS = jnp.asarray(_rng.integers(0, V, size=(N, C)))
W0 = jnp.asarray(_rng.normal(scale=0.5, size=(D, V)), jnp.float32)
ADVANTAGES = jnp.asarray(_rng.normal(size=(N,)), jnp.float32)
LENGTHS = [6, 1, 3, 0, 5, 2, 6, 4]  # varied, including an empty completion
GA_MASK = jnp.asarray(np.arange(C)[None, :] < np.array(LENGTHS)[:, None])


def _logps(w, features, tokens):
    logits = jnp.einsum("ncd,dv->ncv", features, w)
    return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1)[..., 0]


# Old logps from a perturbed W so ratios differ from 1 and some tokens clip.
OLD_LOGPS = _logps(W0 + 0.3 * jnp.asarray(_rng.normal(size=(D, V)), jnp.float32),
                   FEATURES, TOKENS)
REF_LOGPS = _logps(W0 - 0.2, FEATURES, TOKENS)


def _loss(w, rows, mode, num_tokens_total, num_samples_total):
    logps = _logps(w, FEATURES[rows], TOKENS[rows])
    mask = GA_MASK[rows]
    policy, _ = clipped_surrogate(logps, OLD_LOGPS[rows], ADVANTAGES[rows], mask,
                                  clip_low=0.2, clip_high=0.28)
    per_token = policy + 0.1 * kl_penalty(logps, REF_LOGPS[rows], "k3", mask=mask)
    return aggregate_loss(per_token, mask, mode, num_tokens_total=num_tokens_total,
                          num_samples_total=num_samples_total, max_completion_length=C)


MICRO_SIZES = (1, 2, 4)


@jax.jit
def _token_mean_grad(w, rows, num_tokens_total):
    return jax.grad(_loss)(w, rows, LossAggregation.TOKEN_MEAN, num_tokens_total, rows.shape[0])


@functools.lru_cache(maxsize=None)
def _grads_for_every_mode():
    """{mode: ((loss, grad) of the mini batch, [(summed loss, summed grad) per micro size])}.

    Each micro batch is an independent call of the loss on its rows with the mini batch's
    totals, vmapped over the micro batches; all modes share one compile to keep the test fast.
    """

    @jax.jit
    def compute(w):
        num_tokens, num_samples = jnp.sum(GA_MASK), N
        value_and_grad = jax.value_and_grad(_loss)
        out = {}
        for mode in LossAggregation:
            full = value_and_grad(w, jnp.arange(N), mode, num_tokens, num_samples)
            accumulated = []
            for micro in MICRO_SIZES:
                rows = jnp.arange(N).reshape(N // micro, micro)
                losses, grads = jax.vmap(
                    lambda r, mode=mode: value_and_grad(w, r, mode, num_tokens, num_samples)
                )(rows)
                accumulated.append((jnp.sum(losses), jnp.sum(grads, axis=0)))
            out[mode.value] = (full, accumulated)
        return out

    return compute(W0)


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_summed_micro_batch_grads_equal_mini_batch_grad(mode):
    (full_loss, full_grad), accumulated = _grads_for_every_mode()[mode.value]
    assert float(jnp.abs(full_grad).max()) > 1e-3  # the check below is not vacuous
    for micro, (acc_loss, acc_grad) in zip(MICRO_SIZES, accumulated):
        np.testing.assert_allclose(acc_loss, full_loss, rtol=1e-5, atol=1e-6, err_msg=str(micro))
        np.testing.assert_allclose(acc_grad, full_grad, rtol=1e-5, atol=1e-6, err_msg=str(micro))


def test_sequential_micro_batches_match_too():
    # The trainer's literal loop (separate calls, python sum) for one mode and micro size 2.
    (_, full_grad), _ = _grads_for_every_mode()["token-mean"]
    total = int(GA_MASK.sum())
    summed = sum(_token_mean_grad(W0, jnp.arange(s, s + 2), total) for s in range(0, N, 2))
    np.testing.assert_allclose(summed, full_grad, rtol=1e-5, atol=1e-6)
    # Guard on the test itself: micro-batch token counts instead of the total break it.
    wrong = sum(
        _token_mean_grad(W0, jnp.arange(s, s + 2), max(int(GA_MASK[s:s + 2].sum()), 1))
        for s in range(0, N, 2)
    )
    assert not np.allclose(wrong, full_grad, rtol=1e-3)
