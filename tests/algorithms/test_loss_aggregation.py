"""Loss aggregation modes vs hand values, 0/0 guards and mode parsing."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import LossAggregation, aggregate_loss

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.

PER_TOKEN = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0]], bool)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", (1.5 + 4.0) / 2.0),
        ("seq-mean-token-sum", 7.0 / 2.0),
        ("seq-mean-token-sum-norm", 7.0 / (2.0 * 4.0)),  # L = 4
    ],
)
def test_modes_by_hand(mode, expected):
    got = aggregate_loss(PER_TOKEN, MASK, mode, num_tokens_total=3, num_samples_total=2,
                         max_completion_length=4)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_empty_masks_and_nan_padding_give_finite_zero(mode):
    per_token = jnp.array([[jnp.nan, jnp.inf], [2.0, jnp.nan]])
    mask = jnp.array([[0, 0], [1, 0]], bool)
    got = aggregate_loss(per_token, mask, mode, num_tokens_total=1, num_samples_total=2,
                         max_completion_length=2)
    expected = {"token-mean": 2.0, "seq-mean-token-mean": 1.0, "seq-mean-token-sum": 1.0,
                "seq-mean-token-sum-norm": 0.5}[mode.value]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    nothing = aggregate_loss(per_token, jnp.zeros((2, 2), bool), mode, num_tokens_total=0,
                             num_samples_total=0, max_completion_length=2)
    assert float(nothing) == 0.0


def test_parsing():
    assert LossAggregation("token_mean") is LossAggregation.TOKEN_MEAN
    assert LossAggregation("Seq-Mean-Token-Sum-Norm") is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM
    with pytest.raises(ValueError) as err:
        LossAggregation("sequence-mean")
    for member in LossAggregation:
        assert member.value in str(err.value)
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm", num_tokens_total=3,
                       num_samples_total=2)
