"""VLLMEngine against rlbolt's own sampler and log-probs: greedy token for token, logps, weight push.

Runs only where vLLM is importable (the `.venv-vllm` of docs/howto/engines.md) and only with
`-m vllm`. The models are tiny random Llama / Qwen2 folders written here with `save_hf`, with
their final norm scaled up so next-token logits are far apart: greedy then cannot flip between
two float32 implementations (XLA here, oneDNN kernels in vLLM) on a near tie. One vLLM engine
serves most tests (starting one takes ~20 s); tests that change its stop tokens or weights put
them back.
"""

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

torch = pytest.importorskip("torch")

pytest.importorskip("vllm")

from rlbolt.models import Decoder, tiny_config  # noqa: E402
from rlbolt.models.hf_io import save_hf  # noqa: E402
from rlbolt.rollout import NativeSampler, RolloutEngine, token_logps  # noqa: E402
from rlbolt.rollout.vllm_engine import VLLMEngine, hf_named_tensors, request_seed  # noqa: E402

pytestmark = pytest.mark.vllm

VOCAB, MAX_NEW = 128, 10
# vLLM's CPU attention takes head sizes that are multiples of 32 (16 is refused).
CONFIG = tiny_config(vocab_size=VOCAB, head_dim=32)
# Sampled logps: vLLM's float32 forward (oneDNN) vs XLA's differ by ~1e-6 relative per op; over
# two layers and a 128-way log_softmax of logits ~±10 the gap measured ~1e-5. 1e-4 leaves room
# and is still far below any convention error (a temperature or a renormalisation off is >1e-2).
LOGP_TOL = 1e-4


def _model(seed, config=CONFIG):
    model = Decoder(config, rngs=nnx.Rngs(seed))
    norm = model.final_norm.scale  # spread the logits (tied or not): no near ties under greedy
    norm.set_value(norm.get_value() * 8.0)
    return model


def _keys(n, seed=0):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))


def _prompts(n, seed=0, lo=1, hi=12):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, rng.integers(lo, hi + 1))] for _ in range(n)]


def _engine(folder, **overrides):
    options = dict(max_new_tokens=MAX_NEW, temperature=0.0, prompt_buckets=(16,), kv_cache_bytes=32 << 20,
                   enforce_eager=True, max_num_seqs=16)
    options.update(overrides)
    return VLLMEngine(folder, **options)


def _native(model, **overrides):
    options = dict(max_new_tokens=MAX_NEW, temperature=0.0, prompt_buckets=(16,))
    options.update(overrides)
    return NativeSampler(model, **options)


def _recomputed(model, out, temperature):
    graphdef, params = nnx.split(model)
    return np.asarray(token_logps(graphdef, params, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                  out.completion_mask, temperature=temperature, chunk_size=4))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = _model(0)
    folder = save_hf(model, CONFIG, tmp_path_factory.mktemp("llama") / "model")
    return model, folder, _engine(folder)


def test_request_seed_joins_the_two_key_words():
    assert request_seed([0, 0]) == 0
    assert request_seed([1, 2]) == (1 << 32) + 2
    # The first word's top bit is dropped: the seed stays a non-negative int64.
    assert request_seed([0xFFFFFFFF, 0xFFFFFFFF]) == 2**63 - 1
    assert request_seed(np.array([0x80000001, 7], np.uint32)) == (1 << 32) + 7


def test_hf_named_tensors_equal_the_files_save_hf_writes(llama):
    model, folder, _ = llama
    written = safetensors.numpy.load_file(str(folder / "model.safetensors"))
    pushed = {name: tensor.numpy() for name, tensor in hf_named_tensors(nnx.split(model)[1], CONFIG)}
    assert set(pushed) == set(written)
    for name, value in written.items():
        np.testing.assert_array_equal(pushed[name], value, err_msg=name)


def test_hf_named_tensors_of_a_bfloat16_model_keep_its_bits(tmp_path):
    config = tiny_config(vocab_size=VOCAB, head_dim=32, param_dtype="bfloat16", tie_word_embeddings=True)
    model = Decoder(config, rngs=nnx.Rngs(4))
    folder = save_hf(model, config, tmp_path / "bf16")
    from rlbolt.models.hf_io import _SafetensorsReader  # reads bfloat16 tensors, which numpy cannot

    reader = _SafetensorsReader(folder)
    pushed = dict(hf_named_tensors(model, config))  # a Decoder works as well as its State
    assert set(pushed) == set(reader.location) and "lm_head.weight" not in pushed
    for name, tensor in pushed.items():
        assert str(tensor.dtype) == "torch.bfloat16", name
        np.testing.assert_array_equal(tensor.contiguous().view(torch.int16).numpy(),
                                      reader.read(name).view(np.int16), err_msg=name)


def test_greedy_matches_native_sampler_token_for_token(plain):
    model, _, engine = plain
    assert isinstance(engine, RolloutEngine)
    prompts = _prompts(6)
    out = engine.generate(prompts, _keys(6))
    ref = _native(model).generate(prompts, _keys(6))
    np.testing.assert_array_equal(out.prompt_ids, ref.prompt_ids)
    np.testing.assert_array_equal(out.prompt_mask, ref.prompt_mask)
    np.testing.assert_array_equal(out.completion_ids, ref.completion_ids)
    assert out.completion_mask.all() and out.completion_ids.shape == (6, MAX_NEW)
    # greedy reports logps at temperature 1
    np.testing.assert_allclose(out.logps, _recomputed(model, out, 1.0), atol=LOGP_TOL)


def _set_stops(engine, stop, pad_id):
    """Sets the fixture engine's stop tokens and pad id (engine options, not per-call ones)."""
    import dataclasses

    engine.sampling = dataclasses.replace(engine.sampling, stop_token_ids=tuple(stop), pad_id=pad_id)


@pytest.fixture
def plain(llama):
    """The fixture engine with no stop tokens and pad 0, restored after each test that changes them."""
    model, folder, engine = llama
    _set_stops(engine, (), 0)
    yield model, folder, engine
    _set_stops(engine, (), 0)


def test_stop_tokens_mask_through_the_stop_and_pad_after(plain):
    model, _, engine = plain
    prompts = _prompts(8, seed=1)
    greedy = _native(model).generate(prompts, _keys(8))
    # stop on tokens some greedy rows emit at step 3, so those rows stop by step 3
    stop = tuple(sorted({int(t) for t in greedy.completion_ids[:, 3]}))[:3]
    ref = _native(model, stop_token_ids=stop, pad_id=1).generate(prompts, _keys(8))
    _set_stops(engine, stop, pad_id=1)
    out = engine.generate(prompts, _keys(8))
    np.testing.assert_array_equal(out.completion_ids, ref.completion_ids)
    np.testing.assert_array_equal(out.completion_mask, ref.completion_mask)
    lengths = out.completion_mask.sum(1)
    assert lengths.min() < MAX_NEW
    for row, n in enumerate(lengths):
        assert out.completion_mask[row, :n].all() and not out.completion_mask[row, n:].any()
        if n < MAX_NEW:
            assert out.completion_ids[row, n - 1] in stop and (out.completion_ids[row, n:] == 1).all()
            assert (out.logps[row, n:] == 0).all() and (out.logps[row, :n] < 0).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 0.9)])
def test_sampled_logps_match_token_logps_before_filtering(plain, temperature, top_k, top_p):
    model, _, engine = plain
    out = engine.generate(_prompts(6, seed=2), _keys(6, seed=2), temperature=temperature, top_k=top_k, top_p=top_p)
    assert out.completion_mask.all()
    # the convention: log_softmax(logits / temperature) at the sampled token, before top-k/top-p
    np.testing.assert_allclose(out.logps, _recomputed(model, out, temperature), atol=LOGP_TOL)


def test_top_k_one_is_greedy_and_reports_the_scaled_logp(plain):
    # top_k=1 leaves one token: the argmax, whatever the temperature. Its logp must be the
    # temperature-scaled one before filtering (a post-filter logp would be 0).
    model, _, engine = plain
    prompts = _prompts(4, seed=3)
    out = engine.generate(prompts, _keys(4, seed=3), temperature=0.5, top_k=1)
    np.testing.assert_array_equal(out.completion_ids, _native(model).generate(prompts, _keys(4)).completion_ids)
    expected = _recomputed(model, out, 0.5)
    assert (expected < -1e-3).any()
    np.testing.assert_allclose(out.logps, expected, atol=LOGP_TOL)


def test_same_key_same_completion_whatever_the_batch(plain):
    _, _, engine = plain
    prompts, keys = _prompts(6, seed=4), _keys(6, seed=4)
    full = engine.generate(prompts, keys, temperature=1.0)
    # rows 4 and 1 again, in another order, among other prompts and keys
    mixed_prompts = [prompts[4]] + _prompts(3, seed=5) + [prompts[1]]
    mixed_keys = np.concatenate([keys[4:5], _keys(3, seed=5), keys[1:2]])
    part = engine.generate(mixed_prompts, mixed_keys, temperature=1.0)
    np.testing.assert_array_equal(part.completion_ids[0], full.completion_ids[4])
    np.testing.assert_array_equal(part.completion_ids[-1], full.completion_ids[1])
    np.testing.assert_allclose(part.logps[[0, -1]], full.logps[[4, 1]], atol=1e-5)
    alone = engine.generate([prompts[1]], keys[1:2], temperature=1.0)
    np.testing.assert_array_equal(alone.completion_ids[0], full.completion_ids[1])
    # another key for the same prompt gives another completion (the key reaches the sampler)
    other = engine.generate([prompts[1]] * 4, _keys(4, seed=6), temperature=1.0)
    assert len({tuple(row) for row in other.completion_ids}) > 1


def test_left_padded_array_input_equals_list_input(plain):
    _, _, engine = plain
    prompts = _prompts(5, seed=7)
    from_lists = engine.generate(prompts, _keys(5), temperature=1.0)
    from_array = engine.generate(from_lists.prompt_ids, _keys(5), prompt_mask=from_lists.prompt_mask, temperature=1.0)
    np.testing.assert_array_equal(from_array.completion_ids, from_lists.completion_ids)
    np.testing.assert_array_equal(from_array.prompt_ids, from_lists.prompt_ids)


def test_update_weights_then_greedy_matches_native_with_the_new_weights(plain):
    model, _, engine = plain
    prompts = _prompts(6, seed=8)
    before = engine.generate(prompts, _keys(6))
    new_model = _model(1)
    try:
        engine.update_weights(nnx.split(new_model)[1], policy_version=3)
        out = engine.generate(prompts, _keys(6))
        ref = _native(new_model).generate(prompts, _keys(6))
        assert out.policy_version == 3
        assert (out.completion_ids != before.completion_ids).any()  # the push changed the model
        np.testing.assert_array_equal(out.completion_ids, ref.completion_ids)
        np.testing.assert_allclose(out.logps, _recomputed(new_model, out, 1.0), atol=LOGP_TOL)
        # a prompt seen before the push is not served from KV blocks of the old weights
        again = engine.generate(prompts[:1] * 2, _keys(2))
        np.testing.assert_array_equal(again.completion_ids[0], ref.completion_ids[0])
    finally:
        engine.update_weights(model, policy_version=0)  # a Decoder works too; restores the fixture
    np.testing.assert_array_equal(engine.generate(prompts, _keys(6)).completion_ids, before.completion_ids)


def test_update_weights_refuses_another_layout(plain):
    _, _, engine = plain
    other = Decoder(tiny_config(vocab_size=VOCAB, head_dim=32, num_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layers.1"):
        engine.update_weights(nnx.split(other)[1], policy_version=1)


@pytest.mark.parametrize("opts,error,match", [
    ({"min_p": 0.1}, TypeError, "unknown options \\['min_p'\\]"),
    ({"temperature": -1.0}, ValueError, "temperature=-1.0"),
    ({"top_p": 0.0}, ValueError, "top_p=0.0"),
    ({"top_k": VOCAB + 1}, ValueError, "top_k="),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens=0"),
])
def test_bad_options_are_refused_in_one_line(plain, opts, error, match):
    _, _, engine = plain
    with pytest.raises(error, match=match) as info:
        engine.generate(_prompts(2), _keys(2), **opts)
    assert "\n" not in str(info.value)


def test_bad_inputs_are_refused(plain):
    _, _, engine = plain
    with pytest.raises(ValueError, match="rng_keys"):
        engine.generate(_prompts(2), _keys(3))
    with pytest.raises(ValueError, match="rng_keys"):
        engine.generate(_prompts(2), _keys(2).astype(np.int64))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5], []], _keys(2))
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate([[5, VOCAB]], _keys(1))
    with pytest.raises(ValueError, match="prompt_buckets"):
        engine.generate([[5] * 17], _keys(1))
    with pytest.raises(ValueError, match="0 prompts"):
        engine.generate([], _keys(0))


def test_qwen2_folder_greedy_matches_native(tmp_path):
    # vLLM's Qwen2 derives head_dim from hidden_size / heads: 64 / 2 = 32
    config = tiny_config(vocab_size=VOCAB, num_heads=2, num_kv_heads=1, head_dim=32, architecture="Qwen2ForCausalLM",
                         attention_bias=True, tie_word_embeddings=True)
    model = _model(2, config)
    folder = save_hf(model, config, tmp_path / "qwen2")
    engine = _engine(folder)
    prompts = _prompts(4, seed=9)
    out = engine.generate(prompts, _keys(4))
    np.testing.assert_array_equal(out.completion_ids, _native(model).generate(prompts, _keys(4)).completion_ids)
    np.testing.assert_allclose(out.logps, _recomputed(model, out, 1.0), atol=LOGP_TOL)
    # tied embeddings: the pushed embedding must reach vLLM's lm_head too (it loads nothing itself)
    new_model = _model(3, config)
    engine.update_weights(nnx.split(new_model)[1], policy_version=1)
    after = engine.generate(prompts, _keys(4))
    assert (after.completion_ids != out.completion_ids).any()
    np.testing.assert_array_equal(after.completion_ids, _native(new_model).generate(prompts, _keys(4)).completion_ids)
    np.testing.assert_allclose(after.logps, _recomputed(new_model, after, 1.0), atol=LOGP_TOL)


def test_qwen2_folder_whose_head_dim_vllm_would_ignore_is_refused(tmp_path):
    config = tiny_config(vocab_size=VOCAB, head_dim=32, architecture="Qwen2ForCausalLM", attention_bias=True)
    folder = save_hf(Decoder(config, rngs=nnx.Rngs(0)), config, tmp_path / "qwen2")
    with pytest.raises(ValueError, match="head_dim=32 != hidden_size / num_attention_heads = 64/4"):
        VLLMEngine(folder, max_new_tokens=4)


def test_rlbolt_fit_with_rollout_engine_vllm_trains_with_small_mismatch(tmp_path):
    """`rlbolt fit ... --rollout.engine=vllm`: the GRPO recipe's tiny model is written to a folder
    for vLLM, the trainer's weights are pushed every step, and the rollout correction (TIS, on by
    default for another engine) sees engine and trainer logps that agree to float32 rounding."""
    from rlbolt.app.cli import main
    from rlbolt.loggers import read_jsonl

    run_dir = tmp_path / "run"
    tiny = "{hidden_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, head_dim: 32}"  # vLLM CPU: head_dim >= 32
    assert main(["fit", "recipes/configs/grpo_gsm8k.yaml", "--rollout.engine=vllm", "--trainer.max_steps=3", f"--model.tiny={tiny}",
                 f"--trainer.run_dir={run_dir}", "--trainer.val_every_n_steps=null", "--data.builtin_val_rows=0",
                 "--callbacks.progress=false", "--callbacks.metrics=[jsonl]", "--reward.executor=thread"]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert np.isfinite(r["loss/policy"])
        assert abs(r["rollout_corr/kl_k1"]) < 1e-4 and abs(r["rollout_corr/is_weight_mean"] - 1) < 1e-3
        assert r["rollout_corr/token_masked_frac"] == 0.0


def test_a_lora_run_pushes_merged_weights_to_vllm(tmp_path):
    """model.lora with rollout=merged: each step the adapters are merged into the base and the
    merged weights pushed; the engine's logps still agree with the trainer's (TIS metrics)."""
    from rlbolt.app.cli import main
    from rlbolt.loggers import read_jsonl

    run_dir = tmp_path / "run"
    tiny = "{hidden_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, head_dim: 32}"
    lora = "{rank: 4, alpha: 8, rollout: merged}"
    assert main(["fit", "recipes/configs/grpo_gsm8k.yaml", "--rollout.engine=vllm", "--trainer.max_steps=3",
                 f"--model.tiny={tiny}", f"--model.lora={lora}", "--algorithm.lr=0.05", f"--trainer.run_dir={run_dir}",
                 "--trainer.val_every_n_steps=null", "--data.builtin_val_rows=0", "--callbacks.progress=false",
                 "--callbacks.metrics=[jsonl]", "--reward.executor=thread"]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["kl"] > 1e-5  # the adapters moved the policy away from the base (the KL reference)...
    for r in records:  # ...and vLLM sampled from the moved policy: its logps are still the trainer's
        assert abs(r["rollout_corr/kl_k1"]) < 1e-4 and abs(r["rollout_corr/is_weight_mean"] - 1) < 1e-3
