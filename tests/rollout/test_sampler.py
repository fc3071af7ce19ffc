"""NativeSampler: logps agree with token_logps, greedy agrees with a cache-free argmax loop,
stop tokens, early exit, per-sample RNG invariance, zero recompiles within a bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_logps_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler, RolloutEngine
from rollout_jit import token_logps

MAX_NEW = 10


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config(vocab_size=128), rngs=nnx.Rngs(0))


def _keys(n, seed=0):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))


def _prompts(n, seed=0, lo=1, hi=12):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 128, rng.integers(lo, hi + 1))) for _ in range(n)]


def _recomputed_logps(model, out, temperature):
    graphdef, params = nnx.split(model)
    return np.asarray(token_logps(graphdef, params, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                  out.completion_mask, temperature=temperature, chunk_size=4))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logps_match_token_logps(model, temperature):
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=temperature, stop_token_ids=(5, 6, 7),
                            prompt_buckets=(16,))
    out = sampler.generate(_prompts(6), _keys(6))
    assert out.completion_ids.shape == (6, MAX_NEW) and out.prompt_ids.shape == (6, 16)
    assert np.abs(out.logps - _recomputed_logps(model, out, temperature)).max() <= 1e-4
    assert (out.logps[~out.completion_mask] == 0).all() and (out.logps[out.completion_mask] < 0).all()


def test_greedy_is_deterministic_and_matches_cache_free_argmax(model):
    prompts = _prompts(3, seed=4)
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=0.0, prompt_buckets=(16,))
    out = sampler.generate(prompts, _keys(3))
    again = sampler.generate(prompts, _keys(3, seed=99))  # keys are irrelevant when greedy
    np.testing.assert_array_equal(out.completion_ids, again.completion_ids)
    # The slow way: a cache-free forward over the whole sequence each step. Sequences are
    # right-padded to one length (causal attention ignores later slots) so this compiles once.
    length = max(map(len, prompts)) + MAX_NEW
    forward = nnx.jit(lambda m, ids: m(ids, jnp.arange(length, dtype=jnp.int32)[None])[0])
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        for _ in range(MAX_NEW):
            logits = forward(model, jnp.asarray([seq + [0] * (length - len(seq))], jnp.int32))
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        np.testing.assert_array_equal(out.completion_ids[row], seq[len(prompt):])
    assert np.abs(out.logps - _recomputed_logps(model, out, 1.0)).max() <= 1e-4


def test_stop_tokens_end_rows_and_mask_after(model):
    stop = tuple(range(0, 128, 3))  # a third of the vocabulary: rows stop early
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, stop_token_ids=stop, pad_id=0, prompt_buckets=(16,))
    out = sampler.generate(_prompts(8, seed=1), _keys(8, seed=1))
    lengths = out.completion_mask.sum(1)
    assert lengths.min() < MAX_NEW
    for row in range(8):
        n = lengths[row]
        assert out.completion_mask[row, :n].all() and not out.completion_mask[row, n:].any()
        assert not np.isin(out.completion_ids[row, : n - 1], stop).any()
        if n < MAX_NEW:
            assert out.completion_ids[row, n - 1] in stop
            assert (out.completion_ids[row, n:] == 0).all()
    # Early exit: the loop ran only as many decode steps as the longest row needed.
    assert sampler.last_decode_steps == lengths.max() - 1


def test_early_exit_when_every_row_stops_at_first_token(model):
    prompts = _prompts(4, seed=2)
    greedy = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=0.0, prompt_buckets=(16,))
    first_tokens = tuple(int(t) for t in greedy.generate(prompts, _keys(4)).completion_ids[:, 0])
    assert greedy.last_decode_steps == MAX_NEW - 1  # no stop tokens: the full loop
    stopping = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=first_tokens,
                             prompt_buckets=(16,))
    out = stopping.generate(prompts, _keys(4))
    assert stopping.last_decode_steps == 0
    assert (out.completion_mask.sum(1) == 1).all()


def test_samples_depend_only_on_their_own_key(model):
    prompts, keys = _prompts(6, seed=3), _keys(6, seed=3)
    samplers = [NativeSampler(model, max_new_tokens=MAX_NEW, micro_batch_size=m, prompt_buckets=(16,))
                for m in (1, 4, None)]
    outs = [sampler.generate(prompts, keys) for sampler in samplers]
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0].completion_ids, other.completion_ids)
        seq = outs[0].prompt_ids.shape[1] + outs[0].completion_ids.shape[1]  # other micro-batch shapes: the bound
        np.testing.assert_allclose(outs[0].logps, other.logps, rtol=0, atol=decoder_logps_tolerance(model, seq))
    # A sample keeps its tokens when it moves within the batch next to different samples
    # (the micro-batch-4 sampler again: its programs are compiled already).
    moved = samplers[1].generate([prompts[5], prompts[0], prompts[2]], keys[[5, 0, 2]])
    np.testing.assert_array_equal(moved.completion_ids, outs[0].completion_ids[[5, 0, 2]])
    different = samplers[2].generate(prompts, _keys(6, 7))
    assert (different.completion_ids != outs[0].completion_ids).any()


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    prompts = _prompts(4, seed=5)
    greedy = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=0.0, prompt_buckets=(16,))
    want = greedy.generate(prompts, _keys(4)).completion_ids
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, top_k=1, prompt_buckets=(16,))
    np.testing.assert_array_equal(sampler.generate(prompts, _keys(4)).completion_ids, want)
    np.testing.assert_array_equal(sampler.generate(prompts, _keys(4), top_k=0, top_p=1e-6).completion_ids, want)


def test_no_recompiles_within_buckets(model):
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, micro_batch_size=4, stop_token_ids=(1,),
                            prompt_buckets=(8, 16))
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    before = sampler.compiled_count()
    for lo, hi in [(1, 8), (9, 16)]:  # warm up each bucket
        sampler.generate(_prompts(4, lo=lo, hi=hi), _keys(4))
    warm = sampler.compiled_count()
    assert warm - before == 2
    rng = np.random.default_rng(0)
    calls = []
    for call in range(20):
        lo, hi = [(1, 8), (9, 16)][call % 2]
        n = int(rng.integers(1, 9))  # also varies the number of prompts
        calls.append((_prompts(n, seed=call, lo=lo, hi=hi), _keys(n, seed=call)))  # key making compiles
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for prompts, keys in calls:
            sampler.generate(prompts, keys)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert sampler.compiled_count() == warm
    assert compiles == []


def test_update_weights_changes_outputs_and_stamps_version(model):
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, temperature=0.0, prompt_buckets=(16,))
    assert isinstance(sampler, RolloutEngine)
    prompts = _prompts(3, seed=6)
    before = sampler.generate(prompts, _keys(3))
    _, new_params = nnx.split(Decoder(tiny_config(vocab_size=128), rngs=nnx.Rngs(1)))
    sampler.update_weights(new_params, policy_version=7)
    after = sampler.generate(prompts, _keys(3))
    assert before.policy_version == 0 and after.policy_version == 7
    assert (before.completion_ids != after.completion_ids).any()
    _, wrong = nnx.split(Decoder(tiny_config(vocab_size=128, num_layers=1), rngs=nnx.Rngs(1)))
    with pytest.raises(ValueError, match="layout"):
        sampler.update_weights(wrong, 8)


def test_bad_inputs_name_the_problem(model):
    sampler = NativeSampler(model, max_new_tokens=MAX_NEW, prompt_buckets=(8,))
    with pytest.raises(ValueError, match="prompt_buckets"):
        sampler.generate([[3] * 9], _keys(1))
    with pytest.raises(ValueError, match="rng_keys"):
        sampler.generate([[3, 4]], _keys(2))
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([[]], _keys(1))
    with pytest.raises(TypeError, match="unknown options"):
        sampler.generate([[3]], _keys(1), beams=4)
    with pytest.raises(ValueError, match="top_p"):
        NativeSampler(model, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        NativeSampler(model, max_new_tokens=600, prompt_buckets=(8,)).generate([[3]], _keys(1))


def test_the_deprecated_noise_budget_warns_and_changes_nothing(model):
    prompts, keys = _prompts(3, seed=4), _keys(3, seed=4)
    with pytest.warns(DeprecationWarning, match="noise_upfront_max_bytes"):
        old = NativeSampler(model, max_new_tokens=MAX_NEW, prompt_buckets=(16,), noise_upfront_max_bytes=0)
    new = NativeSampler(model, max_new_tokens=MAX_NEW, prompt_buckets=(16,))
    np.testing.assert_array_equal(old.generate(prompts, keys).completion_ids, new.generate(prompts, keys).completion_ids)
