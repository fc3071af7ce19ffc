"""The sampler's prompt once per group and its segmented decode (rollout/sampler.py): the same
samples as every row prefilling its own prompt and reading its whole cache, and logps equal to
an independent forward (`token_logps`, the plain Decoder over `prompt | completion`).

Tolerance: sampled ids and masks exactly equal (Gumbel noise per row key; logits differ by
float32 rounding only, far from a tie on this model and seed); logps 2e-5 between sampler variants,
1e-4 against the forward (as tests/rollout/test_sampler.py)."""

import jax
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_logps_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler
from rollout_jit import token_logps
from rlbolt.rollout.sampler import decode_segments

MAX_NEW = 9


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48)
    return Decoder(config, rngs=nnx.Rngs(7))


def _keys(n, seed=3):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)), np.uint32)


def test_decode_segments_cover_every_step_in_equal_pieces():
    assert decode_segments(10, 3) == (4, 7, 10)  # steps 1..9 in three pieces of three
    assert decode_segments(10, None) == (10,) and decode_segments(10, 9) == (10,)
    assert decode_segments(1, 4) == ()  # one new token: no decode step
    ends = decode_segments(1024, 128)
    sizes = np.diff((1, *ends))
    assert ends[-1] == 1024 and sizes.sum() == 1023 and sizes.max() <= 128 and len(ends) == 8 + 3
    # Segments of 64 or more open with a ramp of 1/8, 1/4, 1/2 of a segment (the first steps read fewer slots).
    assert ends[:4] == (17, 33, 65, 129)
    assert decode_segments(128, 128) == (17, 33, 65, 128)  # one segment's steps, ramp first
    assert decode_segments(20, 128) == (17, 20) and decode_segments(17, 128) == (17,)
    assert decode_segments(10, 32) == (10,)  # under 64: no ramp


def test_groups_share_one_prefill_and_sample_what_separate_prompts_would(model):
    temperature = 1.0  # sampled: ids depend on every logit through the noise (greedy is the easier case)
    # Three prompts of 7, 2 and 5 tokens (left-padded to the bucket of 8), each three times.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 48, n).tolist() for n in (7, 2, 5)]
    rows = [p for p in prompts for _ in range(3)]
    keys = _keys(len(rows))
    outs = {}
    for share, segment in ((True, 3), (False, None), (True, None)):
        s = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=temperature, prompt_buckets=(8,),
                          share_prompts=share, decode_segment=segment)
        outs[share, segment] = (s.generate(rows, keys), s.last_group_size)
    (shared, group), (alone, one) = outs[True, 3], outs[False, None]
    assert (group, one) == (3, 1)
    seq = alone.prompt_ids.shape[1] + alone.completion_ids.shape[1]
    tolerance = decoder_logps_tolerance(model, seq, temperature=temperature or 1.0)  # shared / segmented graphs
    for out, _ in outs.values():
        np.testing.assert_array_equal(out.completion_ids, alone.completion_ids)
        np.testing.assert_array_equal(out.completion_mask, alone.completion_mask)
        np.testing.assert_allclose(out.logps, alone.logps, rtol=0, atol=tolerance)
    # The three samples of a prompt differ (their own keys): sharing did not copy rows.
    assert len({tuple(r) for r in shared.completion_ids[:3]}) > 1
    forward = token_logps(model, None, shared.prompt_ids, shared.prompt_mask, shared.completion_ids,
                          shared.completion_mask, temperature=temperature)
    np.testing.assert_allclose(shared.logps, np.asarray(forward), rtol=0, atol=tolerance)


def test_rows_that_are_not_consecutive_groups_are_not_shared(model):
    a, b = [5, 6, 7], [8, 9]
    s = NativeSampler(model, max_new_tokens=4, temperature=1.0, prompt_buckets=(4,))
    mixed = s.generate([a, b, a, b], _keys(4))
    assert s.last_group_size == 1  # `a b a b`: no block of equal prompts
    grouped = s.generate([a, a, b, b], _keys(4)[[0, 2, 1, 3]])
    assert s.last_group_size == 2
    np.testing.assert_array_equal(grouped.completion_ids, mixed.completion_ids[[0, 2, 1, 3]])


def test_early_exit_skips_every_later_segment(model):
    # Four segments, every row in place (a program of 4 decode loops, not 10); every row stopping at
    # once with compacted segments: tests/rollout/test_compaction.py (test_every_row_stopping_...).
    s = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=1.0, prompt_buckets=(8,),
                      stop_token_ids=tuple(range(48)), decode_segment=2, compact_finished=False)  # every token stops
    out = s.generate([[1, 2, 3]] * 4, _keys(4))
    assert s.last_decode_steps == 0 and out.completion_mask.sum(1).tolist() == [1, 1, 1, 1]


def test_bad_decode_segment_is_refused(model):
    with pytest.raises(ValueError, match="decode_segment=0 must be >= 1 or None"):
        NativeSampler(model, max_new_tokens=4, decode_segment=0)
