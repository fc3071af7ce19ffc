"""`algorithm.policy_loss` picks the per-token objective of a ready module: the papers' defaults
resolve per objective, each objective reaches the loss (checked against the pure function it
names), and GSPO's own default is unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.algorithms import cispo_surrogate, clipped_surrogate, gmpo_surrogate, gspo_surrogate, sapo_surrogate
from rlbolt.config import ConfigError, load_config
from rlbolt.modules import DAPO, GRPO, GSPO


def test_defaults_resolve_per_objective():
    assert load_config().algorithm.policy_loss == "ppo"
    assert load_config({"algorithm": {"name": "gspo"}}).algorithm.policy_loss == "gspo"
    cispo = load_config({"algorithm": {"policy_loss": "cispo"}}).algorithm
    assert (cispo.clip_low, cispo.clip_high) == (1.0, 4.0)  # the objective's, not PPO's 0.2
    dapo_cispo = load_config({"algorithm": {"name": "dapo", "policy_loss": "cispo"}}).algorithm
    assert dapo_cispo.clip_high == 4.0 and dapo_cispo.dynamic_sampling  # the objective wins its own fields
    explicit = load_config({"algorithm": {"policy_loss": "gmpo", "clip_high": 0.3}}).algorithm
    assert (explicit.clip_low, explicit.clip_high) == (0.4, 0.3)  # what the user wrote wins
    assert load_config({"algorithm": {"policy_loss": "kl_cov"}}).algorithm.cov_select_ratio == 2e-3
    with pytest.raises(ConfigError, match="algorithm.policy_loss"):
        load_config({"algorithm": {"policy_loss": "trpo"}})


def _batch(rng, n=4, c=5):
    mask = np.ones((n, c), bool)
    mask[1, 3:] = False
    return {"old_logps": jnp.asarray(rng.normal(-1.0, 0.3, (n, c)), jnp.float32),
            "advantages": jnp.asarray(rng.normal(0, 1, (n,)), jnp.float32), "completion_mask": jnp.asarray(mask),
            "sample_keys": jnp.asarray(rng.integers(0, 2**31, (n, 2)), jnp.uint32)}


@pytest.mark.parametrize("cls, loss, reference", [
    (GRPO, "ppo", lambda l, b, a: clipped_surrogate(l, b["old_logps"], b["advantages"], b["completion_mask"],
                                                    clip_low=a.clip_low, clip_high=a.clip_high)),
    (GSPO, None, lambda l, b, a: gspo_surrogate(l, b["old_logps"], b["advantages"], b["completion_mask"],
                                                clip_low=3e-4, clip_high=4e-4)),
    (GRPO, "cispo", lambda l, b, a: cispo_surrogate(l, b["old_logps"], b["advantages"], b["completion_mask"],
                                                    clip_low=1.0, clip_high=4.0)),
    (DAPO, "sapo", lambda l, b, a: sapo_surrogate(l, b["old_logps"], b["advantages"], b["completion_mask"],
                                                  tau_pos=1.0, tau_neg=1.05)),
    (GRPO, "gmpo", lambda l, b, a: gmpo_surrogate(l, b["old_logps"], b["advantages"], b["completion_mask"],
                                                  clip_low=0.4, clip_high=0.4)),
])
def test_each_objective_reaches_the_module_loss(cls, loss, reference):
    module = cls({"algorithm": {} if loss is None else {"policy_loss": loss}})
    rng = np.random.default_rng(0)
    batch = _batch(rng)
    logps = batch["old_logps"] + jnp.asarray(rng.normal(0, 0.4, batch["old_logps"].shape), jnp.float32)
    got, info = module.policy_loss(logps, batch)
    want, _ = reference(logps, batch, module.algo)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert {"ratio", "clipped"} <= set(info)


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_covariance_objectives_run_jitted_and_reproducibly(loss):
    module = GRPO({"algorithm": {"policy_loss": loss, "cov_select_ratio": 0.25}})
    rng = np.random.default_rng(1)
    batch = _batch(rng)
    logps = batch["old_logps"] + 0.1
    run = jax.jit(lambda l, b: module.policy_loss(l, b)[0])
    first, again = np.asarray(run(logps, batch)), np.asarray(run(logps, batch))
    np.testing.assert_array_equal(first, again)  # the draw comes from the micro batch's sample key
    assert np.all(first[~np.asarray(batch["completion_mask"])] == 0)


# The papers' aggregations: GSPO / GMPO's sequence objective (exact in token form only under
# seq-mean-token-mean), SAPO (arXiv 2511.20347: mean per sequence, then over sequences), CISPO
# (arXiv 2506.13585: normalised by the batch's token count). PPO-based objectives keep the module's.
PAPER_AGGREGATION = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean",
                     "cispo": "token-mean"}
MODULE_AGGREGATION = {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "ppo": "token-mean",
                      "reinforcepp": "token-mean", "drgrpo": "seq-mean-token-sum-norm", "rloo": "seq-mean-token-sum",
                      "gspo": "seq-mean-token-mean"}


@pytest.mark.parametrize("algorithm", sorted(MODULE_AGGREGATION))
def test_each_objective_trains_with_its_papers_aggregation_unless_the_config_says(algorithm):
    for loss in ("ppo", "gspo", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov"):
        got = load_config({"algorithm": {"name": algorithm, "policy_loss": loss}}).algorithm.loss_aggregation
        assert got == PAPER_AGGREGATION.get(loss, MODULE_AGGREGATION[algorithm]), (algorithm, loss)
        for explicit in ("token-mean", "seq-mean-token-sum"):  # what the user wrote wins
            cfg = load_config({"algorithm": {"name": algorithm, "policy_loss": loss, "loss_aggregation": explicit}})
            assert cfg.algorithm.loss_aggregation == explicit
