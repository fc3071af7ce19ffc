"""The host side of plan.packing: first-fit decreasing by hand, row buckets, blocks, and the one
clear line for what cannot be packed (a sample longer than a row, a bad plan or config value)."""

import numpy as np
import pytest

from rlbolt.config import ConfigError
from rlbolt.config.load import load_config
from rlbolt.packing import (PackingError, PackingSpec, bucket_rows, first_fit_decreasing, pack_columns, pack_sources,
                            source_slots)
from rlbolt.plan import BatchPlan, PlanError


def test_first_fit_decreasing_by_hand():
    # Longest first: 7 -> row 0 (1 left); 5 -> row 1 (3 left); 4 -> row 2 (4 left); 3 -> row 1 (0 left);
    # 2 -> row 2 (2 left). Within a row samples keep their index order.
    row, start, used = first_fit_decreasing(np.array([5, 3, 7, 2, 4]), 8)
    assert used == 3
    assert row.tolist() == [1, 1, 0, 2, 2]
    assert start.tolist() == [0, 5, 0, 0, 2]


def test_first_fit_decreasing_ties_and_empty_samples_are_deterministic():
    lengths = np.array([4, 4, 0, 4, 4])  # equal lengths: index order decides; an empty sample takes no room
    for _ in range(2):
        row, start, used = first_fit_decreasing(lengths, 8)
        assert (row.tolist(), start.tolist(), used) == ([0, 0, 0, 1, 1], [0, 4, 8, 0, 4], 2)


def test_a_sample_longer_than_a_row_names_the_field():
    with pytest.raises(PackingError, match=r"plan.packed_row_tokens=6 is shorter than sample 1's 7 tokens"):
        first_fit_decreasing(np.array([3, 7, 2]), 6)


@pytest.mark.parametrize("rows, bucket", [(1, 1), (5, 5), (8, 8), (9, 10), (11, 12), (16, 16), (17, 20), (33, 40),
                                          (100, 112)])
def test_bucket_rows_keeps_three_binary_digits(rows, bucket):
    assert bucket_rows(rows) == bucket
    assert bucket <= rows * 1.25  # at most a quarter more rows than needed


def test_pack_columns_packs_each_block_apart():
    # Two micro batches of 4 samples over 2 batch shards: blocks of 2 samples each, packed on their own.
    lengths = np.array([3, 5, 8, 1, 2, 2, 6, 6])
    cols = pack_columns(lengths, 4, PackingSpec(row_tokens=8, blocks=2), padded_width=10)
    rows = cols["pack_rows"].argmax(1)
    assert cols["pack_rows"].shape == (8, 2)  # the most any block needs: [8, 1] and [6, 6] take two rows
    assert cols["pack_rows"].sum(1).tolist() == [1] * 8
    assert rows.tolist() == [0, 0, 0, 1, 0, 0, 0, 1]
    assert cols["pack_starts"].tolist() == [0, 3, 0, 0, 0, 2, 0, 0]


def test_pack_columns_group_of_one_and_bad_split():
    cols = pack_columns(np.array([4, 9, 1]), 1, PackingSpec(), padded_width=9)  # micro batches of one sample
    assert cols["pack_rows"].tolist() == [[True]] * 3 and cols["pack_starts"].tolist() == [0, 0, 0]
    with pytest.raises(PackingError, match="train_micro_batch_size a multiple of the batch shards"):
        pack_columns(np.array([1, 2, 3, 4]), 4, PackingSpec(blocks=3), padded_width=4)


def test_bad_packing_values_get_one_line():
    with pytest.raises(PlanError, match="packing='yes' must be 'off' or 'on'"):
        BatchPlan(2, 2, packing="yes")
    with pytest.raises(ConfigError, match=r"plan.packing='yes' is not allowed"):
        load_config({"plan": {"packing": "yes"}})
    with pytest.raises(ConfigError, match=r"plan.packed_row_tokens=64 is read only with plan.packing=on"):
        load_config({"plan": {"packed_row_tokens": 64}})
    with pytest.raises(ConfigError, match=r"plan.packed_row_tokens=16 is below .* = 288"):
        load_config({"plan": {"packing": "on", "packed_row_tokens": 16}})
    with pytest.raises(ConfigError, match=r"plan.packed_rows=2 is read only with plan.packing=on"):
        load_config({"plan": {"packed_rows": 2}})
    assert load_config({"plan": {"packing": "on", "packed_row_tokens": 288}}).plan.packed_row_tokens == 288


def test_run_updates_hands_each_micro_batch_its_packed_rows():
    import jax

    from rlbolt.batch import Batch
    from rlbolt.distributed.mesh import MeshSpec
    from rlbolt.distributed.sharding import ShardingPlan
    from rlbolt.train_batch import run_updates

    n, p, c = 8, 3, 4
    prompt_mask = np.arange(p)[None] >= p - np.array([1, 3, 2, 3, 1, 1, 2, 3])[:, None]
    completion_mask = np.arange(c)[None] < np.array([4, 0, 1, 4, 2, 4, 3, 1])[:, None]
    batch = Batch(prompt_ids=np.ones((n, p), np.int32), prompt_mask=prompt_mask, completion_ids=np.ones((n, c), np.int32),
                  completion_mask=completion_mask, policy_version=np.zeros(n, np.int32))
    seen = []

    def update(params, opt_state, micro):
        seen.append({k: np.asarray(v) for k, v in micro.items()})
        return params, opt_state, {"loss": jax.numpy.zeros(())}

    sharding = ShardingPlan(MeshSpec().build(jax.devices()[:1]))
    plan = BatchPlan(2, 4, mini_batch_size=4, train_micro_batch_size=2, packing="on", packed_row_tokens=8)
    run_updates(update, batch, plan, sharding, None, None, 0)
    assert len(seen) == 2 and seen[0]["pack_rows"].shape == (2, 2, 2)  # [A, M/A, R]: two mini batches of 2 x 2
    # Real tokens per sample: 5 3 | 3 7 | 3 5 | 5 4 (micro batches of two), rows of 8 tokens: 5 + 3 share a
    # row (starts 0, 5), 7 and 3 do not (the 7 first), 3 + 5 share one (index order: starts 0, 3), 5 and 4 do not.
    rows = np.concatenate([m["pack_rows"].reshape(4, 2).argmax(1) for m in seen]).tolist()
    starts = np.concatenate([m["pack_starts"].reshape(4) for m in seen]).tolist()
    assert rows == [0, 0, 1, 0, 0, 0, 0, 1] and starts == [0, 5, 0, 0, 0, 3, 0, 0]
    # Predictors of each completion token (row * 8 + column - 1), by hand for the first mini batch: samples
    # 0 (prompt 1, completion 4, row 0 at 0) -> 0 1 2 3, sample 1 none; sample 3 (prompt 3, completion 4, row 0)
    # -> 2 3 4 5, sample 2 (prompt 2, completion 1, row 1) -> 8 + 1. The most any block holds: 2 + 4 = 6 (samples
    # 4, 5), so 6 slots, 3 a sample.
    assert seen[0]["pack_sources"].tolist() == [[[0, 1, 2], [3, 0, 0]], [[9, 2, 3], [4, 5, 0]]]
    off = BatchPlan(2, 4, mini_batch_size=4, train_micro_batch_size=2)
    seen.clear()
    run_updates(update, batch, off, sharding, None, None, 0)
    assert "pack_rows" not in seen[0]


def test_the_planner_counts_packed_tokens(monkeypatch):
    from types import SimpleNamespace

    import rlbolt.planning.compile as compile_module
    from rlbolt.planning.compile import packed_layout, packed_sources
    from rlbolt.planning.schema import train_batch

    def run(**plan):  # what packed_layout reads: the plan, the batch shards, the widths (prompt 32 + completion 96)
        return SimpleNamespace(plan=SimpleNamespace(**plan), sharding=SimpleNamespace(batch_shards=2),
                               module=SimpleNamespace(completion_width=96))

    monkeypatch.setattr(compile_module, "prompt_width", lambda run: 32)
    assert packed_layout(run(packing="off"), 8) is None
    # At most one row per sample per shard (8 samples over 2 shards), rows of the padded width 32 + 96.
    assert packed_layout(run(packing="on", packed_row_tokens=None, packed_rows=None), 8) == (4, 128)
    assert packed_layout(run(packing="on", packed_row_tokens=256, packed_rows=1), 8) == (1, 256)
    batch = train_batch(2, 4, 32, 96, reference=False, packed_rows=3)
    assert batch["pack_rows"].shape == (2, 4, 3) and batch["pack_starts"].shape == (2, 4)
    assert "pack_sources" not in batch and "pack_rows" not in train_batch(2, 4, 32, 96, reference=False)
    batch = train_batch(2, 4, 32, 96, reference=False, packed_rows=3, packed_sources=5)
    assert batch["pack_sources"].shape == (2, 4, 5) and batch["pack_sources"].dtype == np.int32
    # The pack_sources column the planner compiles, per sample: blocks of 4 samples, completions of 96.
    # Rows not fixed: the most a block can hold, 4 x 96 = 384 (already three binary digits), over 4 = 96.
    assert packed_sources(run(packing="on", packed_row_tokens=None, packed_rows=None), 8) == 96
    # One fixed row of 256 tokens: min(256, 384) = 256 slots, 64 a sample.
    assert packed_sources(run(packing="on", packed_row_tokens=256, packed_rows=1), 8) == 64
    assert packed_sources(run(packing="off"), 8) is None


def test_the_planners_pack_sources_width_is_the_runs_at_its_worst():
    # A block of 3 samples whose completions (width 5) are all real: the run's own pack_sources is as
    # wide as the shape source_slots gives the planner (3 x 5 = 15 -> bucketed 16, over 3 -> 6).
    prompt, completion = np.ones((3, 2), bool), np.ones((3, 5), bool)
    spec = PackingSpec()
    cols = pack_columns(prompt.sum(1) + completion.sum(1), 3, spec, padded_width=7)
    assert pack_sources(prompt, completion, cols, 3, spec, 7).shape == (3, source_slots(3, 5, 7)) == (3, 6)
    half = completion.copy()
    half[:, 3:] = False  # fewer real tokens: narrower at run time (9, bucketed 10, 4 a sample), never wider
    assert pack_sources(prompt, half, cols, 3, spec, 7).shape == (3, source_slots(3, 5, 7, forward_tokens=9)) == (3, 4)


def test_fixed_packed_rows_refuse_a_micro_batch_that_needs_more():
    cols = pack_columns(np.array([4, 4, 4]), 3, PackingSpec(row_tokens=8, rows=3), padded_width=8)
    assert cols["pack_rows"].shape == (3, 3)  # fixed: 3 rows although 2 hold the samples
    with pytest.raises(PackingError, match=r"plan.packed_rows=1 is fewer than the 2 rows a micro batch block needs"):
        pack_columns(np.array([4, 4, 4]), 3, PackingSpec(row_tokens=8, rows=1), padded_width=8)


def test_pack_sources_list_each_completion_tokens_predictor_by_hand():
    # Rows of 8: samples 0 (prompt 2 of 3, completion 2) and 1 (prompt 1, completion 3) share row 0 at columns
    # 0 and 4; sample 2 (prompt 3, no completion) sits in row 1. Sample 0's completion tokens sit at columns
    # 2, 3 (predicted from 1, 2); sample 1's at 5, 6, 7 (from 4, 5, 6). Five tokens: 5 slots, 2 a sample.
    prompt = np.array([[False, True, True], [False, False, True], [True, True, True]])
    completion = np.array([[True, True, False], [True, True, True], [False, False, False]])
    spec = PackingSpec(row_tokens=8)
    cols = pack_columns(prompt.sum(1) + completion.sum(1), 3, spec, padded_width=6)
    assert cols["pack_rows"].argmax(1).tolist() == [0, 0, 1] and cols["pack_starts"].tolist() == [0, 4, 0]
    assert pack_sources(prompt, completion, cols, 3, spec, 6).tolist() == [[1, 2], [4, 5], [6, 0]]
    # plan.packed_rows fixed: the slots do not follow the data (min(3 rows x 8, 3 samples x 3) = 9, 3 a sample).
    fixed = PackingSpec(row_tokens=8, rows=3)
    cols = pack_columns(prompt.sum(1) + completion.sum(1), 3, fixed, padded_width=6)
    assert pack_sources(prompt, completion, cols, 3, fixed, 6).tolist() == [[1, 2, 4], [5, 6, 0], [0, 0, 0]]
    # No completion token at all: one slot a sample, never read.
    none = np.zeros_like(completion)
    cols = pack_columns(prompt.sum(1), 3, spec, padded_width=6)
    assert pack_sources(prompt, none, cols, 3, spec, 6).tolist() == [[0], [0], [0]]
