"""Every new loss on hostile padding: NaN / inf logps on masked tokens, an empty row, a one-token row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import (
    cispo_surrogate,
    clip_cov_surrogate,
    distillation_loss,
    gmpo_surrogate,
    kl_cov_surrogate,
    rollout_correction,
    sapo_surrogate,
)

MASK_NP = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
MASK = jnp.asarray(MASK_NP)
_rng = np.random.default_rng(5)
OLD_NP = _rng.normal(size=MASK_NP.shape) * 0.5 - 1.0
NEW_NP = OLD_NP + _rng.normal(size=MASK_NP.shape) * 0.3
for array, junk in ((OLD_NP, np.nan), (NEW_NP, np.inf)):
    array[~MASK_NP] = junk
NEW_NP[1, 1] = -np.inf
OLD = jnp.asarray(OLD_NP, jnp.float32)
NEW = jnp.asarray(NEW_NP, jnp.float32)
ADV = jnp.array([1.0, -1.0, 2.0])

LOSSES = {
    "cispo": lambda x: cispo_surrogate(x, OLD, ADV, MASK),
    "sapo": lambda x: sapo_surrogate(x, OLD, ADV, MASK),
    "gmpo": lambda x: gmpo_surrogate(x, OLD, ADV, MASK),
    "clip_cov": lambda x: clip_cov_surrogate(x, OLD, ADV, MASK, jax.random.key(0), select_ratio=0.5, cov_low=-9.0),
    "kl_cov": lambda x: kl_cov_surrogate(x, OLD, ADV, MASK, select_ratio=0.5),
    "distill": lambda x: distillation_loss(x, OLD, OLD - 0.5, MASK, task_advantages=ADV),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_padding_never_leaks(name):
    loss, _ = LOSSES[name](NEW)
    grad = jax.grad(lambda x: jnp.sum(LOSSES[name](x)[0]))(NEW)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad)), name
    np.testing.assert_array_equal(np.asarray(loss)[~MASK_NP], 0.0)
    np.testing.assert_array_equal(np.asarray(grad)[~MASK_NP], 0.0)
    assert np.any(np.asarray(grad)[MASK_NP] != 0.0), name  # the valid tokens do learn


def test_rollout_correction_on_hostile_padding():
    for mode, level in (("tis", "sequence"), ("mis", "geometric"), ("icepop", "token"), ("mask", "sequence")):
        weights, keep, metrics = rollout_correction(OLD, NEW, MASK, mode=mode, level=level)
        assert np.all(np.isfinite(weights)), mode
        np.testing.assert_array_equal(np.asarray(weights)[~MASK_NP], 0.0)
        assert not np.any(np.asarray(keep)[~MASK_NP])
        assert all(np.isfinite(v) for v in metrics.values()), mode
