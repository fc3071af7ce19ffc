"""DAPO overlong penalty."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import overlong_penalty

# Tolerances (tests/float_tolerance.py's rule: a derived bound or a reason). These compare float32
# objectives on a few dozen hand-set values with float64 NumPy or hand arithmetic: every value goes
# through fewer than ~20 float32 operations and sums of at most ~50 terms, so it lies within ~50 ulps
# (6e-6 relative) of float64 on any CPU (sum_error_bound: n * eps). rtol=1e-5 is 84 ulps; rtol=1e-6
# (8 ulps) only for single exp/log/divide chains; atol=1e-6 / 1e-7 for values that are 0 in float64.


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16, linear to -1 at 20, -1 beyond.
    got = overlong_penalty(jnp.array([0, 16, 17, 18, 20, 21, 100]), max_length=20, cache_length=4)
    np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -1, -1, -1], atol=1e-7)
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(jnp.array([1]), max_length=4, cache_length=8)
