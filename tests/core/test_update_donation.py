"""The optimizer update donates what it replaces: the compiled executable aliases the
parameters' and optimizer state's buffers to its outputs (XLA's input/output aliasing), the
inputs are deleted by the call, and the Trainer donates only what nothing reads afterwards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlbolt.batch import Batch
from rlbolt.update import make_update_fn


def _step(params, micro):
    # A quadratic in the params, weighted per sample: the gradient is a fixed, nonzero tensor.
    w = micro["completion_mask"].astype(jnp.float32).sum()
    loss = w * (jnp.sum(params["a"] ** 2) + jnp.sum(params["b"] * 3.0)) / micro["mini_batch_num_samples"][0]
    return loss, {}


def _state():
    params = {"a": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones((5,), jnp.float32)}
    tx = optax.adamw(1e-2)
    return tx, params, tx.init(params)


def _micro():
    return Batch({"completion_mask": np.ones((1, 2, 3), bool)})  # [A=1, M/A=2, T=3]


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("donate", [("params", "opt_state"), ("opt_state",), ()])
def test_compiled_update_aliases_exactly_the_donated_state(donate):
    tx, params, opt_state = _state()
    update = make_update_fn(_step, tx, 1, donate=donate)
    compiled = update.func.lower(params, opt_state, _micro(), None).compile()
    expected = (_nbytes(params) if "params" in donate else 0) + (_nbytes(opt_state) if "opt_state" in donate else 0)
    assert expected != 0 or donate == ()
    # AdamW's state is (count int32[], mu, nu) and a params-sized tree each: all of it aliases.
    assert compiled.memory_analysis().alias_size_in_bytes == expected


def test_donated_inputs_are_deleted_and_the_result_is_the_undonated_one():
    tx, params, opt_state = _state()
    kept = make_update_fn(_step, tx, 1, donate=())(params, opt_state, _micro())
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    donated = make_update_fn(_step, tx, 1)(params, opt_state, _micro())
    assert all(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(donated), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # the same computation, bit for bit


def test_unknown_donation_is_refused():
    tx, _, _ = _state()
    with pytest.raises(ValueError, match=r"donate=.*'frozen'.*cannot be donated"):
        make_update_fn(_step, tx, 1, donate=("frozen",))
