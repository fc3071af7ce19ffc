"""Every estimator and loss compiles under jit (no host syncs) and matches its eager result."""

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.algorithms import (
    clipped_value_loss,
    gae_advantages,
    group_reward_spread,
    gspo_surrogate,
    kl_in_reward,
    reinforcepp_advantages,
    truncated_importance_weights,

# Tolerances (tests/float_tolerance.py's rule): jit against eager runs the same float32 element-wise
# ops and reductions of <= 8 terms, fused or not; a fusion may reorder a sum (<= 8 * eps relative,
# sum_error_bound) or an exp/log by an ulp or two: rtol=1e-5 (84 ulps), atol=1e-6 for zeros.
)


def test_jit_matches_eager():
    rng = np.random.default_rng(3)
    n, c = 4, 5
    a, b, v = (jnp.asarray(rng.normal(size=(n, c)), jnp.float32) for _ in range(3))
    mask = jnp.asarray(np.arange(c)[None, :] < np.array([5, 2, 0, 3])[:, None])
    rewards = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    ids = jnp.array([10, 4, 10, 4])

    def everything(a, b, v, mask, rewards, ids):
        return {
            "rpp": reinforcepp_advantages(rewards, mask, kl=a - b, kl_coef=0.1, group_ids=ids),
            "gae": gae_advantages(a, v, mask, 0.99, 0.95),
            "spread": group_reward_spread(rewards, ids),
            "gspo": gspo_surrogate(a, b, rewards, mask)[0],
            "tis": truncated_importance_weights(a, b, mask, 2.0),
            "value": clipped_value_loss(v, b, a, mask, 0.2)[0],
            "klr": kl_in_reward(rewards, a, b, mask, 0.05, "k3"),
        }

    eager = everything(a, b, v, mask, rewards, ids)
    jitted = jax.jit(everything)(a, b, v, mask, rewards, ids)
    for name in eager:
        for e, j in zip(jax.tree.leaves(eager[name]), jax.tree.leaves(jitted[name])):
            assert np.all(np.isfinite(e)), name
            np.testing.assert_allclose(j, e, rtol=1e-5, atol=1e-6, err_msg=name)


def test_newer_objectives_jit_match_eager():
    from rlbolt.algorithms import (
        cispo_surrogate,
        clip_cov_surrogate,
        distillation_loss,
        gmpo_surrogate,
        kl_cov_surrogate,
        rollout_correction,
        sapo_surrogate,
    )

    rng = np.random.default_rng(4)
    n, c = 4, 5
    a, b, t = (jnp.asarray(rng.normal(size=(n, c)) * 0.3 - 1.0, jnp.float32) for _ in range(3))
    mask = jnp.asarray(np.arange(c)[None, :] < np.array([5, 2, 0, 3])[:, None])
    adv = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    key = jax.random.key(7)

    def everything(a, b, t, mask, adv, key):
        return {
            "cispo": cispo_surrogate(a, b, adv, mask)[0],
            "sapo": sapo_surrogate(a, b, adv, mask)[0],
            "gmpo": gmpo_surrogate(a, b, adv, mask)[0],
            "clip_cov": clip_cov_surrogate(a, b, adv, mask, key, select_ratio=0.3, cov_low=-1.0)[0],
            "kl_cov": kl_cov_surrogate(a, b, adv, mask, select_ratio=0.3)[0],
            "distill": distillation_loss(a, b, t, mask, task_advantages=adv)[0],
            "mis": rollout_correction(a, b, mask, mode="mis", level="geometric"),
        }

    eager = everything(a, b, t, mask, adv, key)
    jitted = jax.jit(everything)(a, b, t, mask, adv, key)
    for name in eager:
        for e, j in zip(jax.tree.leaves(eager[name]), jax.tree.leaves(jitted[name])):
            assert np.all(np.isfinite(e)), name
            np.testing.assert_allclose(j, e, rtol=1e-5, atol=1e-6, err_msg=name)
