"""DAPO overlong penalty."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import overlong_penalty


def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16, linear to -1 at 20, -1 beyond.
    got = overlong_penalty(jnp.array([0, 16, 17, 18, 20, 21, 100]), max_length=20, cache_length=4)
    np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -1, -1, -1], atol=1e-7)
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(jnp.array([1]), max_length=4, cache_length=8)
