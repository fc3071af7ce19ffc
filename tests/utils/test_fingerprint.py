"""The weights fingerprint: equal weights agree, any one-ulp change or a move of values does not."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rlbolt.utils.fingerprint import fingerprint


def _tree(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((17, 8)).astype(dtype), "layers": [rng.standard_normal((8, 8)).astype(dtype)],
            "count": np.arange(5, dtype=np.int32)}


def test_equal_trees_agree_whatever_holds_them():
    a = _tree()
    assert fingerprint(a) == fingerprint(_tree()) == fingerprint(jax.tree.map(jnp.asarray, a))
    assert len(fingerprint(a)) == 64 and int(fingerprint(a), 16) >= 0


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_one_ulp_anywhere_changes_it(dtype):
    base = _tree(dtype=dtype)
    reference = fingerprint(base)
    for index in [(0, 0), (16, 7), (5, 3)]:
        changed = _tree(dtype=dtype)
        changed["embed"][index] = np.nextafter(changed["embed"][index].astype(np.float32), np.float32(np.inf)).astype(dtype) \
            if dtype is np.float32 else (changed["embed"][index].view(np.uint16) + 1).view(ml_dtypes.bfloat16)
        assert fingerprint(changed) != reference, index


def test_moved_values_paths_dtypes_and_shapes_all_count():
    reference = fingerprint(_tree())
    swapped = _tree()
    swapped["embed"][[0, 1]] = swapped["embed"][[1, 0]]  # same multiset of values, other positions
    assert fingerprint(swapped) != reference
    renamed = _tree()
    renamed["lm_head"] = renamed.pop("embed")
    assert fingerprint(renamed) != reference
    assert fingerprint(jax.tree.map(lambda x: x.astype(np.float64) if x.dtype == np.float32 else x, _tree())) != reference
    reshaped = _tree()
    reshaped["layers"][0] = reshaped["layers"][0].reshape(4, 16)
    assert fingerprint(reshaped) != reference
    flipped_zero = _tree()
    flipped_zero["layers"][0][2, 2] = 0.0
    negative_zero = _tree()
    negative_zero["layers"][0][2, 2] = -0.0  # equal as numbers, different weights on disk
    assert fingerprint(flipped_zero) != fingerprint(negative_zero)


def test_a_different_seed_differs():
    assert fingerprint(_tree(0)) != fingerprint(_tree(1))
