"""A token a rollout correction dropped (`mis`, `icepop`, `mask`) is out of the objective: every
`algorithm.policy_loss` gets exactly 0 gradient on it, and whatever an objective pools over a row
or the batch (GMPO's and GSPO's sequence ratios, Clip-Cov's and KL-Cov's covariance) is what it
would be with the token removed from the sequence (float64 references written here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import aggregate_loss
from rlbolt.modules import GRPO
from float_tolerance import EPS32

# Float32 against float64: ~10 roundings of order-1 values (a log-ratio, a clip, a mean over <= 5
# terms, exp, log of a weight, products); 64 ulps covers them with margin, and the faults these
# tests catch move the results by 1e-2 or more.
RTOL = 64 * EPS32

COMPLETION = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
DROPPED = np.zeros_like(COMPLETION)
DROPPED[0, 1] = DROPPED[1, 3] = True  # one dropped token in the middle of row 0, the last of row 1
KEEP = COMPLETION & ~DROPPED
ADV = np.array([1.0, -1.5, 0.7])
_rng = np.random.default_rng(0)
OLD = _rng.normal(-1.0, 0.3, COMPLETION.shape).astype(np.float32)
SHIFT = _rng.normal(0.0, 0.05, COMPLETION.shape)
SHIFT[DROPPED] = [-2.5, 3.0]  # far, on the side GMPO does not clip (A > 0: down; A < 0: up)
LOGPS = (OLD + SHIFT).astype(np.float32)
WEIGHTS = np.where(KEEP, _rng.uniform(0.6, 1.5, COMPLETION.shape), 0.0).astype(np.float32)


def _batch(keep=KEEP, weights=WEIGHTS):
    return {"old_logps": jnp.asarray(OLD), "advantages": jnp.asarray(ADV, jnp.float32),
            "completion_mask": jnp.asarray(COMPLETION), "keep_mask": jnp.asarray(keep),
            "importance_weights": jnp.asarray(weights),
            "sample_keys": jnp.asarray(np.arange(6).reshape(3, 2), jnp.uint32)}


def _module(loss, **extra):
    return GRPO({"algorithm": {"policy_loss": loss, "loss_aggregation": "seq-mean-token-mean", **extra}})


def _total(module, batch):
    def total(logps):
        per_token, _ = module.policy_loss(logps, batch)
        return aggregate_loss(per_token, batch["completion_mask"], "seq-mean-token-mean",
                              num_tokens_total=int(COMPLETION.sum()), num_samples_total=3)
    return total


def _log_ratio64():
    return np.asarray(LOGPS, np.float64) - np.asarray(OLD, np.float64)


OBJECTIVES = [("ppo", {}), ("gspo", {}), ("cispo", {}), ("sapo", {}), ("gmpo", {}),
              ("clip_cov", {"cov_select_ratio": 1.0, "clip_cov_low": 0.0, "clip_cov_high": 0.05}),
              ("kl_cov", {"cov_select_ratio": 0.2})]


@pytest.mark.parametrize("loss, extra", OBJECTIVES, ids=[o[0] for o in OBJECTIVES])
def test_a_dropped_token_gets_exactly_zero_gradient(loss, extra):
    module = _module(loss, **extra)
    grad = np.asarray(jax.grad(_total(module, _batch()))(jnp.asarray(LOGPS)))
    assert np.all(grad[DROPPED] == 0.0), grad[DROPPED]
    assert np.any(np.abs(grad[KEEP]) > 1e-3)  # the kept tokens still learn
    per_token, _ = module.policy_loss(jnp.asarray(LOGPS), _batch())
    assert np.all(np.asarray(per_token)[DROPPED] == 0.0)


def _gmpo64(keep, weights, eps=0.4):
    """GMPO with weights, float64: s_i over the kept tokens, times the weights' geometric mean there."""
    lr = _log_ratio64()
    out = np.zeros(len(ADV))
    for i, (a, k) in enumerate(zip(ADV, keep)):
        sign = np.sign(a)
        chosen = sign * np.minimum(sign * lr[i, k], sign * np.clip(lr[i, k], -eps, eps))
        out[i] = np.exp(chosen.mean()) * np.exp(np.log(np.asarray(weights[i, k], np.float64)).mean())
    return out  # s_i * G_i(w)


def test_gmpo_pools_the_kept_tokens_and_takes_the_weights_geometric_mean():
    per_token, info = _module("gmpo").policy_loss(jnp.asarray(LOGPS), _batch())
    ratio = _gmpo64(KEEP, WEIGHTS)
    want = np.where(KEEP, -ADV[:, None] * ratio[:, None], 0.0)
    np.testing.assert_allclose(per_token, want, rtol=RTOL)
    # The module's loss: each row's kept tokens carry -A_i s_i G_i, and the row divides by its full
    # length (a dropped token keeps its place in the normaliser).
    total = _total(_module("gmpo"), _batch())(jnp.asarray(LOGPS))
    want_total = np.sum(KEEP.sum(1) / COMPLETION.sum(1) * -ADV * ratio) / 3
    np.testing.assert_allclose(total, want_total, rtol=RTOL)
    # The arithmetic alternative (each token's loss times its weight) is measurably different here.
    geometric = ratio / _gmpo64(KEEP, np.where(KEEP, 1.0, 0.0))
    arithmetic = np.array([np.mean(WEIGHTS[i, KEEP[i]]) for i in range(3)])
    assert np.all(np.abs(geometric - arithmetic) > 1e-3)
    np.testing.assert_allclose(info["seq_weight"], geometric, rtol=RTOL)


def test_gmpo_sequence_level_weights_are_the_same_either_way():
    """A weight shared by a row (a sequence-level correction): geometric and arithmetic means agree."""
    shared = np.where(KEEP, np.array([[0.5], [2.0], [1.25]]), 0.0).astype(np.float32)
    per_token, _ = _module("gmpo").policy_loss(jnp.asarray(LOGPS), _batch(weights=shared))
    unweighted, _ = _module("gmpo").policy_loss(jnp.asarray(LOGPS), _batch(weights=np.where(KEEP, 1.0, 0.0)))
    np.testing.assert_allclose(per_token, np.asarray(unweighted) * shared, rtol=RTOL)


def test_gspo_sequence_ratio_is_over_the_kept_tokens():
    per_token, info = _module("gspo").policy_loss(jnp.asarray(LOGPS), _batch())
    lr = _log_ratio64()
    s = np.array([np.exp(lr[i, KEEP[i]].mean()) for i in range(3)])
    np.testing.assert_allclose(info["seq_ratio"], s, rtol=RTOL)
    a = ADV[:, None]
    # The GRPO module with policy_loss gspo keeps GRPO's clip range, 0.2.
    clipped = -np.minimum(s[:, None] * a, np.clip(s[:, None], 0.8, 1.2) * a)
    np.testing.assert_allclose(per_token, np.where(KEEP, clipped * WEIGHTS, 0.0), rtol=RTOL)


def _cov64(keep):
    lp, adv = np.asarray(LOGPS, np.float64), np.broadcast_to(ADV[:, None], KEEP.shape)
    return (lp - lp[keep].mean()) * (adv - adv[keep].mean())


def test_kl_cov_selects_by_the_kept_tokens_covariance():
    module = _module("kl_cov", cov_select_ratio=0.2)
    per_token, info = module.policy_loss(jnp.asarray(LOGPS), _batch())
    cov = _cov64(KEEP)
    np.testing.assert_allclose(np.asarray(info["cov"])[KEEP], cov[KEEP], rtol=RTOL, atol=RTOL)
    count = max(1, int(0.2 * KEEP.sum()))  # floor(0.2 * 10 kept tokens) = 2
    top = np.argsort(-np.where(KEEP, cov, -np.inf), axis=None)[:count]
    want = np.zeros(KEEP.size, bool)
    want[top] = True
    np.testing.assert_array_equal(info["kl_penalised"], want.reshape(KEEP.shape))
    lr = _log_ratio64()
    loss = (-np.exp(lr) * ADV[:, None] + np.where(want.reshape(KEEP.shape), np.abs(lr), 0.0)) * WEIGHTS
    np.testing.assert_allclose(per_token, np.where(KEEP, loss, 0.0), rtol=RTOL, atol=RTOL)


def test_clip_cov_detaches_by_the_kept_tokens_covariance():
    extra = {"cov_select_ratio": 1.0, "clip_cov_low": 0.0, "clip_cov_high": 0.05}
    module = _module("clip_cov", **extra)
    _, info = module.policy_loss(jnp.asarray(LOGPS), _batch())
    cov = _cov64(KEEP)
    ratio = np.exp(_log_ratio64())
    a = ADV[:, None]
    ppo_clipped = np.clip(ratio, 0.8, 1.2) * a < ratio * a
    band = KEEP & (cov >= 0.0) & (cov <= 0.05) & ~ppo_clipped  # ratio 1: every candidate is drawn
    np.testing.assert_array_equal(info["cov_detached"], band)
    assert band.any() and not np.array_equal(band, COMPLETION & (_cov64(COMPLETION) >= 0) & (_cov64(COMPLETION) <= .05)
                                             & ~ppo_clipped)
    grad = np.asarray(jax.grad(_total(module, _batch()))(jnp.asarray(LOGPS)))
    assert np.all(grad[band] == 0.0) and np.all(grad[DROPPED] == 0.0)


def test_a_sequence_level_drop_removes_the_whole_row():
    keep = KEEP.copy()
    keep[2] = False  # level=sequence / geometric mis drops every token of a row
    weights = np.where(keep, WEIGHTS, 0.0)
    for loss in ("gmpo", "gspo"):
        module = _module(loss)
        grad = np.asarray(jax.grad(_total(module, _batch(keep, weights)))(jnp.asarray(LOGPS)))
        per_token, _ = module.policy_loss(jnp.asarray(LOGPS), _batch(keep, weights))
        assert np.all(grad[2] == 0.0) and np.all(np.asarray(per_token)[2] == 0.0)
        full, _ = module.policy_loss(jnp.asarray(LOGPS), _batch())
        np.testing.assert_array_equal(np.asarray(per_token)[:2], np.asarray(full)[:2])  # other rows untouched
