import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.batch import Batch, BatchSchemaError, check_stage


def _batch(n=4, c=3):
    return Batch(
        prompt_ids=np.arange(n * 2, dtype=np.int32).reshape(n, 2),
        prompt_mask=np.ones((n, 2), bool),
        completion_ids=np.arange(n * c, dtype=np.int32).reshape(n, c),
        completion_mask=np.ones((n, c), bool),
        group_ids=np.array([5, 5, 9, 9][:n], np.int32),
        policy_version=np.zeros(n, np.int32),
    )


def test_repeat_keeps_groups_contiguous():
    b = Batch(x=np.array([10, 20]), s=np.array(["a", "b"], dtype=object))
    r = b.repeat(3)
    assert r["x"].tolist() == [10, 10, 10, 20, 20, 20]
    assert r["s"].tolist() == ["a", "a", "a", "b", "b", "b"]


def test_split_chunk_concat_roundtrip_and_select():
    b = _batch()
    parts = b.split([1, 3])
    assert [p.num_samples for p in parts] == [1, 3]
    again = Batch.concat(parts)
    for k in b:
        np.testing.assert_array_equal(again[k], b[k])
    assert [c["group_ids"].tolist() for c in b.chunk(2)] == [[5, 5], [9, 9]]
    assert b.select(np.array([3, 0]))["prompt_ids"].tolist() == [[6, 7], [0, 1]]
    assert b.select(np.array([False, True, False, True])).num_samples == 2


def test_bad_sizes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="a=2, b=3"):
        Batch(a=np.zeros(2), b=np.zeros(3))
    with pytest.raises(ValueError, match="chunks of 3"):
        _batch().chunk(3)
    with pytest.raises(ValueError, match="do not add up to 4"):
        _batch().split([1, 1])
    with pytest.raises(ValueError, match="column names differ"):
        Batch.concat([Batch(a=np.zeros(1)), Batch(b=np.zeros(1))])


def test_from_rows_numeric_ragged_and_strings():
    b = Batch.from_rows([{"p": [1, 2], "q": [1], "a": "x", "n": 3}, {"p": [3, 4], "q": [1, 2], "a": "y", "n": 4}])
    assert b["p"].dtype.kind == "i" and b["p"].shape == (2, 2)
    assert b["q"].dtype == object and b["q"][1] == [1, 2]
    assert b["a"].dtype == object
    assert sorted(b.numeric()) == ["n", "p"]


def test_batch_is_a_pytree_that_jits():
    b = Batch(x=jnp.arange(4.0), y=jnp.ones((4, 2)))
    out = jax.jit(lambda bb: bb.with_columns(z=bb["x"] * 2))(b)
    assert isinstance(out, Batch) and out["z"].tolist() == [0, 2, 4, 6]
    assert sorted(jax.tree_util.tree_leaves(b)[0].tolist()) == [0, 1, 2, 3]


def test_immutable():
    b = _batch()
    with pytest.raises(AttributeError):
        b.x = 1


def test_stage_schema_passes_and_names_stage_column_and_shapes():
    b = _batch()
    assert check_stage(b, "rollout") is b
    with pytest.raises(BatchSchemaError, match=r"stage 'logps': missing column 'old_logps'"):
        check_stage(b, "logps")
    bad = b.with_columns(old_logps=np.zeros((4, 5), np.float32))
    with pytest.raises(BatchSchemaError, match=r"'old_logps' has shape \[4, 5\], expected \[N=4, C=3\]"):
        check_stage(bad, "logps")
    wrong_dtype = b.with_columns(completion_mask=np.ones((4, 3), np.float32))
    with pytest.raises(BatchSchemaError, match=r"'completion_mask' has dtype float32, expected bool"):
        check_stage(wrong_dtype, "rollout")


def test_advantages_may_be_per_sample_or_per_token():
    b = _batch().with_columns(old_logps=np.zeros((4, 3), np.float32), rewards=np.zeros(4, np.float32))
    check_stage(b.with_columns(advantages=np.zeros(4, np.float32)), "advantage")
    check_stage(b.with_columns(advantages=np.zeros((4, 3), np.float32)), "train")
    with pytest.raises(BatchSchemaError, match=r"expected \[N=4\] or \[N=4, C=3\]"):
        check_stage(b.with_columns(advantages=np.zeros((4, 2), np.float32)), "advantage")
