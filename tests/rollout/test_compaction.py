"""Compaction of finished rows (rollout/compaction.py): the decode segments after the first run
only the rows still going, at B, B/2 or B/4 rows, and the samples are those of the loop that
keeps every row.

Reference: the same sampler with `compact_finished=False` (every row computed to the end, as
before compaction existed; tests/rollout/test_sampler*.py check that loop against an
independent forward), and the independent forward `token_logps` here too. Tolerance: ids and
masks exactly equal (Gumbel noise per row key and step, so a compacted row draws what it drew
in place); logps 2e-5 (the compacted rows read their prompt through a gathered copy: float32
rounding only).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_logps_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler
from rollout_jit import token_logps
from rlbolt.rollout.compaction import (branch_for, compaction_sizes, put_rows, run_compacted, running_first,
                                       take_rows)
from rlbolt.rollout.sampler import _generate, decode_segments

VOCAB, MAX_NEW, SEGMENT = 48, 24, 6
STOPS = tuple(range(2, 8))  # 6 of 48 ids: about one row in eight stops at each step


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48)
    return Decoder(config, rngs=nnx.Rngs(7))


def _keys(n, seed=3):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)), np.uint32)


def _rows(groups, group, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(8, VOCAB, n).tolist() for n in rng.integers(2, 8, groups)]  # no stop id in a prompt
    return [p for p in prompts for _ in range(group)]


def test_sizes_halve_until_odd_and_the_branch_is_the_smallest_that_holds():
    assert compaction_sizes(64) == (64, 32, 16)
    assert compaction_sizes(12) == (12, 6, 3)
    assert compaction_sizes(6) == (6, 3)  # 3 is odd: no 1.5-row batch
    assert compaction_sizes(7) == (7,) and compaction_sizes(1) == (1,)
    sizes = (64, 32, 16)
    got = [int(branch_for(jnp.asarray(n), sizes)) for n in (64, 33, 32, 17, 16, 1, 0)]
    assert got == [0, 0, 1, 1, 2, 2, 2]


def test_running_rows_come_first_in_order_and_no_row_twice():
    done = jnp.asarray([True, False, True, False, False, True, True, False])
    idx = np.asarray(running_first(done, 6))
    np.testing.assert_array_equal(idx[:4], [1, 3, 4, 7])  # the running rows, in their order
    assert len(set(idx.tolist())) == 6 and set(idx[4:].tolist()) <= {0, 2, 5, 6}


def test_take_and_put_rows_are_inverse_and_scalars_pass_through():
    state = (jnp.int32(5), jnp.arange(8 * 3).reshape(8, 3), jnp.arange(8) > 3)
    idx = jnp.asarray([6, 1, 2], jnp.int32)
    part = take_rows(state, idx)
    assert int(part[0]) == 5 and part[1].shape == (3, 3)
    np.testing.assert_array_equal(part[1][:, 0], [18, 3, 6])
    changed = (jnp.int32(9), part[1] * 0 - 1, ~part[2])
    back = put_rows(state, changed, idx)
    assert int(back[0]) == 9  # the subset's scalar (e.g. the step it reached)
    expect = np.arange(24).reshape(8, 3)
    expect[[6, 1, 2]] = -1
    np.testing.assert_array_equal(back[1], expect)
    np.testing.assert_array_equal(back[2], [False, True, True, False, True, True, False, True])


def test_run_compacted_runs_the_running_rows_at_the_smallest_size_and_writes_them_back():
    sizes = (8, 4, 2)
    seen = []

    def run(state, idx):
        seen.append(state[1].shape[0])  # traced once per branch
        return state[0] + 1, state[1] + 100

    done = jnp.asarray([True, True, False, True, True, True, False, True])  # 2 running: the size-2 branch
    step, values = jax.jit(lambda s, d: run_compacted(s, d, run, sizes))((jnp.int32(0), jnp.arange(8)), done)
    assert sorted(seen) == [2, 4, 8]  # every size compiled into one executable
    assert int(step) == 1
    np.testing.assert_array_equal(values, [0, 1, 102, 3, 4, 5, 106, 7])  # only rows 2 and 6 ran


# Greedy in the slow tier: sampling (per-row keys through compaction) is the stricter case.
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_compacted_samples_equal_the_loop_that_keeps_every_row(model, temperature):
    rows = _rows(groups=4, group=3)  # 12 rows: compacted segments run at 6 or 3 rows
    keys = _keys(len(rows))
    outs = {}
    for compact in (True, False):
        s = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=temperature, prompt_buckets=(8,),
                          stop_token_ids=STOPS, decode_segment=SEGMENT, compact_finished=compact)
        outs[compact] = s.generate(rows, keys)
    got, want = outs[True], outs[False]
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
    seq = got.prompt_ids.shape[1] + got.completion_ids.shape[1]  # decode steps regrouped: the network's bound
    tolerance = decoder_logps_tolerance(model, seq, temperature=temperature or 1.0)  # greedy: temperature-1 logps
    np.testing.assert_allclose(got.logps, want.logps, rtol=0, atol=tolerance)
    lengths = got.completion_mask.sum(1)
    # The case compaction is for: rows ending in different segments while others run on (greedy
    # rows of one prompt are alike: 4 prompts give fewer lengths).
    assert len(set(lengths.tolist())) >= (2 if temperature == 0 else 4) and lengths.min() < MAX_NEW // 2, lengths
    assert (lengths == MAX_NEW).any()
    for ids, n in zip(got.completion_ids, lengths):  # a row ends at its first stop id, then pad
        stops = np.flatnonzero(np.isin(ids[:n], STOPS))
        assert (n == MAX_NEW and stops.size == 0) or (stops.size == 1 and stops[0] == n - 1)
        assert (ids[n:] == 0).all()
    if temperature:  # and against an independent forward over prompt | completion
        ref = token_logps(model, None, got.prompt_ids, got.prompt_mask, got.completion_ids, got.completion_mask)
        np.testing.assert_allclose(np.where(got.completion_mask, got.logps, 0),
                                   np.where(got.completion_mask, np.asarray(ref), 0), rtol=0, atol=tolerance)


@pytest.mark.slow  # the grouped rows above take the same compaction path
def test_rows_without_groups_compact_the_same(model):
    rows = _rows(groups=8, group=1, seed=1)  # 8 different prompts: nothing shared
    keys = _keys(len(rows), seed=5)
    outs = [NativeSampler(model, max_new_tokens=MAX_NEW, temperature=1.0, prompt_buckets=(8,), stop_token_ids=STOPS,
                          decode_segment=SEGMENT, compact_finished=c).generate(rows, keys)
            for c in (True, False)]
    np.testing.assert_array_equal(outs[0].completion_ids, outs[1].completion_ids)
    seq = outs[0].prompt_ids.shape[1] + outs[0].completion_ids.shape[1]
    np.testing.assert_allclose(outs[0].logps, outs[1].logps, rtol=0, atol=decoder_logps_tolerance(model, seq))


def test_every_row_stopping_at_its_first_token_returns_one_token_rows(model):
    # A copy of the model whose first token is always a stop id: its output projection scores stop ids
    # 2 and 3 only, one of them 1e4 * |h . 1| above every other id (h: the final hidden state). The
    # layout and sampler options are those of the compacted sampler above: its program is reused.
    stopping = nnx.clone(model)
    kernel = np.zeros(stopping.lm_head.kernel.get_value().shape, np.float32)
    kernel[:, 2], kernel[:, 3] = 1e4, -1e4
    stopping.lm_head.kernel.set_value(jnp.asarray(kernel))
    rows = _rows(groups=4, group=3)
    s = NativeSampler(stopping, max_new_tokens=MAX_NEW, temperature=1.0, prompt_buckets=(8,), stop_token_ids=STOPS,
                      decode_segment=SEGMENT)
    out = s.generate(rows, _keys(len(rows), seed=4))
    assert (out.completion_mask.sum(1) == 1).all() and s.last_decode_steps == 0
    assert np.isin(out.completion_ids[:, 0], (2, 3)).all() and (out.completion_ids[:, 1:] == 0).all()


def _while_row_counts(jaxpr, width):
    """Row counts of the [rows, width] int32 arrays (the output ids) carried by while loops."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            found |= {v.aval.shape[0] for v in eqn.invars
                      if v.aval.ndim == 2 and v.aval.shape[1] == width and v.aval.dtype == jnp.int32}
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found |= _while_row_counts(sub, width)
    return found


def test_the_executable_holds_one_loop_per_size_and_compacts_only_after_the_first_segment(model):
    graphdef, params = nnx.split(model)
    sp = NativeSampler(model, max_new_tokens=MAX_NEW, stop_token_ids=STOPS).sampling
    ids, mask = jnp.ones((4, 8), jnp.int32), jnp.ones((4, 8), bool)
    trace = lambda compact, segments: jax.make_jaxpr(functools.partial(  # noqa: E731
        _generate, graphdef=graphdef, sp=sp, group=4, segments=segments, compact=compact))(
        params, ids, mask, jnp.zeros((16, 2), jnp.uint32))
    segments = decode_segments(MAX_NEW, SEGMENT)
    assert _while_row_counts(trace(True, segments).jaxpr, MAX_NEW) == {16, 8, 4}
    assert _while_row_counts(trace(False, segments).jaxpr, MAX_NEW) == {16}
    assert _while_row_counts(trace(True, (MAX_NEW,)).jaxpr, MAX_NEW) == {16}  # one segment: nothing to compact
