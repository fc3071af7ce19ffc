"""Tied groups get exactly zero advantage in every estimator; outliers and singletons match float64.

The fault class (moments.py): float32 cannot average most values exactly, so a naive group mean of
16 x 1.1 is one ulp off, the std is ~1e-7, and `centred / (std + eps)` gives every member ~0.1.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbolt.algorithms import (
    drgrpo_advantages,
    group_mean,
    group_reward_spread,
    group_std,
    grpo_advantages,
    grpo_process_advantages,
    masked_whiten,
    reinforcepp_advantages,
    rloo_advantages,
)
from rlbolt.batch import Batch
from rlbolt.modules import DAPO, GRPO, GSPO, RLOO, DrGRPO

# Tolerances (tests/float_tolerance.py's rule): the hypothesis case (groups of <= 6 rewards, |r| <= ~130)
# leaves a centred value within 6 * eps * sum|r| ~ 6e-4 absolute of float64 (sum_error_bound): atol=1e-3
# (GRPO divides by the group's std: 1e-4 there). Elsewhere rtol=1e-5 (84 ulps) on the means and stds that
# moments.py computes to a few ulps (the point of this file), and bit equality for tied groups.

# float32 cannot represent these, nor (for most group sizes) their average.
TIED_VALUES = (0.1, 1.1, 1 / 3, 0.7)
STEPS = 3  # completion width for the token-level estimators


def _seq_estimators():
    """name -> (rewards [N], ids [N]) -> advantages, each jitted once per shape."""
    mask_of = lambda r: jnp.ones((r.shape[0], STEPS), bool)  # noqa: E731
    return {
        "grpo": grpo_advantages,
        "grpo_ddof0": functools.partial(grpo_advantages, ddof=0),
        "drgrpo": drgrpo_advantages,
        "rloo": rloo_advantages,
        "reinforcepp_baseline": lambda r, ids: reinforcepp_advantages(r, mask_of(r), group_ids=ids),
        "grpo_process": lambda r, ids: grpo_process_advantages(jnp.repeat(r[:, None], STEPS, 1), ids),
        "spread_std": lambda r, ids: group_reward_spread(r, ids).std,
        "spread_range": lambda r, ids: group_reward_spread(r, ids).range,
        "group_std": lambda r, ids: group_std(r, ids, ddof=1),
    }


# One compiled program for all of them: a third of the compile time of nine separate ones.
_ALL = jax.jit(lambda rewards, ids: {name: fn(rewards, ids) for name, fn in _seq_estimators().items()})


def estimate(rewards, ids) -> dict:
    """{estimator name: [N] advantages (or group statistic) as NumPy}."""
    return {name: np.asarray(value) for name, value in _ALL(jnp.asarray(rewards, jnp.float32), jnp.asarray(ids, jnp.int32)).items()}


N = 128  # every test below uses this batch size, so each estimator compiles once


def _packed(value):
    """Tied groups of sizes 1..15 (120 samples) and 8 singletons, ids interleaved, not sorted."""
    ids = np.concatenate([np.full(size, 1000 - 7 * size) for size in range(1, 16)] + [np.arange(8) * 11 + 3])
    order = np.random.default_rng(0).permutation(N)
    return jnp.full(N, value, jnp.float32), jnp.asarray(ids[order], jnp.int32)


@pytest.mark.parametrize("value", TIED_VALUES)
def test_many_tied_groups_in_one_batch_get_exactly_zero(value):
    rewards, ids = _packed(value)
    for name, got in estimate(rewards, ids).items():
        assert np.count_nonzero(got) == 0, (name, value, got[got != 0][:4])
    np.testing.assert_array_equal(group_mean(rewards, ids), rewards)  # the mean is the value itself
    # The same in a plain mask whitening (PPO, REINFORCE++): a constant batch whitens to 0.
    mask = np.ones((N, STEPS), bool)
    assert np.count_nonzero(masked_whiten(jnp.full((N, STEPS), value, jnp.float32), mask)) == 0


def test_one_tied_group_of_each_size_next_to_a_varied_group():
    """Sizes 2..128 in a fixed 128-sample batch: the tied group, then samples that all differ
    (so the tied group's zeros cannot come from a batch-wide special case)."""
    rng = np.random.default_rng(0)
    filler = rng.normal(size=N).astype(np.float32)
    for value in TIED_VALUES:
        for size in range(2, N + 1):
            rewards = jnp.asarray(np.concatenate([np.full(size, value, np.float32), filler[: N - size]]))
            ids = jnp.asarray(np.r_[np.zeros(size), np.ones(N - size)].astype(np.int32))
            for name, got in estimate(rewards, ids).items():
                if name == "spread_range":
                    continue
                assert np.count_nonzero(got[:size]) == 0, (name, value, size, got[:4])


def test_the_issue_case_16_samples_scoring_1_1_through_every_module():
    rewards = np.full(16, np.float32(1.0) + np.float32(0.1), np.float32)  # answer 1.0 + format 0.1
    filler = np.arange(N - 16, dtype=np.float32) % 3  # more groups whose rewards differ
    batch = Batch(rewards=np.concatenate([rewards, filler]),
                  group_ids=np.r_[np.zeros(16), 1 + np.arange(N - 16) // 4].astype(np.int32))
    for cls in (GRPO, GSPO, DrGRPO, RLOO, DAPO):
        module = cls({"algorithm": {"name": cls.algorithm_name}})
        kept = module.filter_groups(batch)
        advantages = np.asarray(module.compute_advantages(kept))
        if cls is DAPO:  # its dynamic-sampling filter drops the tied group outright
            assert kept.num_samples == N - 16 and 0 not in np.asarray(kept["group_ids"])
        else:
            assert kept.num_samples == N and np.count_nonzero(advantages[:16]) == 0, cls.__name__


def _reference(rewards, ids, ddof):
    """float64 loops: GRPO (ddof), Dr.GRPO, RLOO and the group std."""
    out = {k: np.zeros(len(rewards)) for k in ("grpo", "drgrpo", "rloo", "std")}
    rewards = np.asarray(rewards, np.float64)
    for i in range(len(rewards)):
        group = rewards[ids == ids[i]]
        k = len(group)
        centred = rewards[i] - group.mean()
        std = group.std(ddof=ddof) if k > ddof else 0.0
        out["std"][i] = std
        out["drgrpo"][i] = centred
        out["grpo"][i] = centred / (std + 1e-6)
        out["rloo"][i] = rewards[i] - (group.sum() - rewards[i]) / (k - 1) if k > 1 else 0.0
    return out


@pytest.mark.parametrize("outlier", [1e6, -1e6, 1e30, -1e30, 3e38, -3e38])
def test_a_single_huge_outlier_matches_float64(outlier):
    # 15 tied members and one outlier; a singleton group of the outlier; a varied group.
    head = [1.1] * 15 + [outlier] + [outlier] + [0.5, 2.0, -1.0]
    rewards = np.array(head + [0.0] * (N - len(head)), np.float32)
    ids = np.array([0] * 16 + [1] + [2, 2, 2] + list(range(3, 3 + N - len(head))), np.int32)
    ref = _reference(rewards.astype(np.float64), ids, ddof=1)
    scale = np.maximum(np.abs(ref["drgrpo"]), 1.0)
    got = estimate(rewards, ids)
    np.testing.assert_allclose(got["grpo"], ref["grpo"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["drgrpo"] / scale, ref["drgrpo"] / scale, rtol=1e-5)
    np.testing.assert_allclose(got["rloo"] / scale, ref["rloo"] / scale, rtol=1e-5)
    np.testing.assert_allclose(got["group_std"], ref["std"], rtol=1e-5)
    # Whitening a batch with one huge token: float64 (v - mean) / std.
    values = np.zeros((N, STEPS), np.float32)
    values[2, 1] = outlier
    expected = (values.astype(np.float64) - values.mean(dtype=np.float64)) / values.std(dtype=np.float64)
    np.testing.assert_allclose(masked_whiten(values, np.ones((N, STEPS), bool)), expected, rtol=1e-5)


def test_two_maximal_rewards_do_not_overflow_the_mean():
    rewards = np.array([3e38, 3e38, -1.0] + [0.0] * (N - 3), np.float32)  # their float32 sum is inf
    ids = np.r_[[0, 0, 0], np.arange(1, N - 2)].astype(np.int32)
    ref = _reference(rewards.astype(np.float64), ids, ddof=1)
    np.testing.assert_allclose(estimate(rewards, ids)["grpo"], ref["grpo"], rtol=1e-5)
    np.testing.assert_allclose(group_mean(rewards, ids)[:3], np.full(3, 2e38), rtol=1e-6)


def test_groups_of_one_get_zero_whatever_their_reward():
    rewards = np.random.default_rng(1).normal(size=N).astype(np.float32) * 1e3
    ids = np.arange(N) * 5
    for name, got in estimate(rewards, ids).items():
        assert np.count_nonzero(got) == 0, name


@settings(max_examples=30, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.booleans(), st.floats(-100, 100, width=32), st.integers(1, 6)),
        min_size=1, max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_mixed_tied_and_varied_groups_match_float64(groups, seed):
    """Tied groups (any float32 value, any size) are exactly 0; varied ones match float64."""
    rng = np.random.default_rng(seed)
    rewards, ids, tied = [], [], []
    for g, (is_tied, value, size) in enumerate(groups):
        values = np.full(size, value) if is_tied else value + rng.normal(size=size) * 10
        rewards.extend(values)
        ids.extend([g * 3 + 1] * size)
        tied.extend([is_tied or size == 1] * size)
    pad = N - len(rewards)  # a fixed N keeps one compiled kernel: pad with singletons (advantage 0)
    rewards = np.asarray(rewards + [0.0] * pad, np.float32)
    ids, tied = np.asarray(ids + list(range(-pad, 0)), np.int32), np.asarray(tied + [True] * pad)
    ref = _reference(rewards.astype(np.float64), ids, ddof=1)
    got = estimate(rewards, ids)
    for name in ("grpo", "drgrpo", "rloo", "reinforcepp_baseline", "grpo_process"):
        assert np.count_nonzero(got[name][tied]) == 0, name
    np.testing.assert_allclose(got["grpo"], ref["grpo"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["drgrpo"], ref["drgrpo"], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(got["rloo"], ref["rloo"], rtol=1e-5, atol=1e-3)
