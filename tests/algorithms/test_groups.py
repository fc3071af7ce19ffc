"""Group statistics over arbitrary ids, and masked helpers, vs hand values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import (
    dense_group_index,
    group_count,
    group_mean,
    group_range,
    group_std,
    last_token_one_hot,
    masked_whiten,
    sequence_to_token_rewards,

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.
)

IDS = jnp.array([7, 7, 3, 3, 3, 42])
VALUES = jnp.array([1.0, 3.0, 2.0, 4.0, 9.0, -5.0])


def test_dense_index_groups_equal_ids_only():
    index = np.asarray(jax.jit(dense_group_index)(IDS))
    assert index[0] == index[1] and index[2] == index[3] == index[4]
    assert len({index[0], index[2], index[5]}) == 3
    assert index.min() >= 0 and index.max() < 6


def test_group_statistics_by_hand():
    np.testing.assert_array_equal(group_count(IDS), [2, 2, 3, 3, 3, 1])
    np.testing.assert_allclose(group_mean(VALUES, IDS), [2, 2, 5, 5, 5, -5], rtol=1e-6)
    # group 3: deviations -3, -1, 4 -> squares sum 26; ddof 1 -> 13; group 7: 2 / 1.
    np.testing.assert_allclose(
        group_std(VALUES, IDS, ddof=1),
        [np.sqrt(2), np.sqrt(2), np.sqrt(13), np.sqrt(13), np.sqrt(13), 0.0], rtol=1e-6,
    )
    np.testing.assert_allclose(group_range(VALUES, IDS), [2, 2, 7, 7, 7, 0])


def test_std_of_large_offset_is_accurate():
    values = jnp.array([1e6 + 1.0, 1e6 - 1.0], jnp.float32)
    np.testing.assert_allclose(group_std(values, jnp.array([0, 0])), [1.0, 1.0], rtol=1e-6)


def test_group_ids_must_be_1d():
    with pytest.raises(ValueError, match="group_ids"):
        dense_group_index(jnp.zeros((2, 3), jnp.int32))


def test_last_token_and_sequence_rewards():
    mask = jnp.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(
        last_token_one_hot(mask),
        [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]],
    )
    np.testing.assert_allclose(
        sequence_to_token_rewards(jnp.array([2.0, -1.0, 5.0]), mask),
        [[0, 2, 0, 0], [0, 0, -1, 0], [0, 0, 0, 0]],
    )


def test_masked_whiten_by_hand():
    values = jnp.array([[1.0, 3.0, 100.0], [5.0, 7.0, -100.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
    # valid 1, 3, 5, 7: mean 4, population std sqrt(5).
    s = np.sqrt(5.0)
    np.testing.assert_allclose(
        masked_whiten(values, mask), [[-3 / s, -1 / s, 0], [1 / s, 3 / s, 0]], rtol=1e-6
    )
