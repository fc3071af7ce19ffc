"""Mistral, Gemma 2 and Gemma 3 against transformers where sliding windows, soft-capping and the two
RoPE bases matter most: long greedy generations through the sampler's decode segments, prompt
sharing and compaction; completion log-probabilities (prompts shared or not, attention in chunks);
and the config fields rlbolt refuses. Checkpoint logits, bf16 loading and export are covered for
these families by test_hf_checkpoint.py (they are in test_hf_config.FAMILIES)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from float_tolerance import EPS32, bf16_tolerance, decoder_tolerance, log_softmax_tolerance
from models.test_hf_config import build_hf_model, hf_logits, rlbolt_logits

from rlbolt.models.config import ModelConfig
from rlbolt.models.decoder import Decoder
from rlbolt.models.hf_config import config_from_hf
from rlbolt.models.hf_io import load_hf
from rlbolt.models.rope import rope_inv_freq
from rlbolt.rollout import NativeSampler, token_logps

WINDOWED = ["gemma2_softcap_tied", "gemma3_two_bases", "mistral_window"]
NEW_TOKENS = 40  # ten times the window of 4: every decode segment after the first runs past it
# Decode segments of 13 steps: three (steps 1-14, -27, -40), so the completion cache grows twice and the rows
# still running are compacted at two segment starts. Each segment after the first is one more compiled copy
# of the decode loop per compaction size (3 here): segments of 8 (five) compiled 13 copies per sampler, 7 now.
SEGMENT = 13
WEIGHT_SCALE = 12.0  # as test_hf_generate: larger weights give varied greedy sequences


def _scaled_hf_folder(name, folder):
    """A transformers model with weights scaled up (saved to folder): attention scores large enough
    for soft-capping at 5 to bite, and varied greedy sequences."""
    hf_model = build_hf_model(name)
    with torch.no_grad():
        for param_name, param in hf_model.named_parameters():
            if param.ndim >= 2 and "embed_tokens" not in param_name:  # experts are 3-D
                param.mul_(WEIGHT_SCALE)
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    hf_model.save_pretrained(folder, safe_serialization=True)
    return hf_model


def _hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def _stop_token(first: list[int], second: list[int]) -> int:
    """A token the first completion emits between steps 3 and 20 (first time) and the second not before 30."""
    for step in range(3, 20):
        token = first[step]
        if token not in first[:step] and token not in second[:30]:
            return token
    raise AssertionError("no usable stop token: the test would not exercise compaction")


def _until_stop(tokens: list[int], stop: int) -> list[int]:
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


# About a minute each on 2 CPU cores (segments x compaction sizes compile): one family in the default tier.
@pytest.mark.parametrize("name", [WINDOWED[0], *(pytest.param(n, marks=pytest.mark.slow) for n in WINDOWED[1:])])
def test_sampler_greedy_matches_generate_across_windows_segments_sharing_and_compaction(tmp_path, name):
    hf_model = _scaled_hf_folder(name, tmp_path)
    model, config = load_hf(tmp_path)
    rng = np.random.default_rng(11)
    short, long = (rng.integers(0, config.vocab_size, size=n).tolist() for n in (6, 13))  # window 4: both longer
    want_short, want_long = _hf_greedy(hf_model, short), _hf_greedy(hf_model, long)
    assert len(set(want_short)) >= 4 and len(set(want_long)) >= 4  # varied enough to catch a wrong window

    # Without stop tokens: every row runs all 40 steps, decode segments of 13 grow the completion cache.
    prompts = [short, short, long, long]  # two groups of two: each prompt prefilled once and shared
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), len(prompts)))
    sampler = NativeSampler(model, max_new_tokens=NEW_TOKENS, temperature=0.0, decode_segment=SEGMENT)
    out = sampler.generate(prompts, keys)
    assert sampler.last_group_size == 2
    for row, want in zip(np.asarray(out.completion_ids), [want_short, want_short, want_long, want_long]):
        assert row.tolist() == want

    # A stop token that ends the short prompt's rows early: later segments run on the compacted long rows.
    stop = _stop_token(want_short, want_long)
    sampler = NativeSampler(model, max_new_tokens=NEW_TOKENS, temperature=0.0, decode_segment=SEGMENT,
                            stop_token_ids=(stop,), pad_id=0)
    out = sampler.generate(prompts, keys)
    ids, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
    for row, row_mask, want in zip(ids, mask, [want_short, want_short, want_long, want_long]):
        expected = _until_stop(want, stop)
        assert row[row_mask].tolist() == expected
    assert mask[0].sum() < 20 and mask[2].sum() > 30


def _batch(rng, vocab, b, p, c):
    prompt_ids = rng.integers(0, vocab, (b, p)).astype(np.int32)
    completion_ids = rng.integers(0, vocab, (b, c)).astype(np.int32)
    prompt_mask = np.zeros((b, p), bool)
    completion_mask = np.zeros((b, c), bool)
    for row in range(0, b, 2):  # groups of two rows with one prompt
        prompt_ids[row + 1] = prompt_ids[row]
        prompt_mask[row: row + 2, rng.integers(0, p - 5):] = True
    for row in range(b):
        completion_mask[row, : rng.integers(c // 2, c + 1)] = True
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _hf_token_logps(hf_model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """float64 log_softmax of transformers' logits over `prompt | completion`, at the completion tokens,
    and the largest logit (the scale of their float32 rounding)."""
    ids = np.concatenate([prompt_ids, completion_ids], 1)
    mask = np.concatenate([prompt_mask, completion_mask], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.from_numpy(ids.astype(np.int64)),
                          attention_mask=torch.from_numpy(mask.astype(np.int64)),
                          position_ids=torch.from_numpy(positions.astype(np.int64))).logits.double().numpy()
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    z = logits[:, p - 1: p + c - 1]
    scale = np.abs(z).max()
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.where(completion_mask, np.take_along_axis(logp, completion_ids[..., None], -1)[..., 0], 0.0), scale


# jitted as the trainer runs it (one program per case; op by op, the first family compiled ~400 primitives)
_jit_token_logps = jax.jit(token_logps, static_argnums=0, static_argnames=("chunk_size", "group_size"))


@pytest.mark.parametrize("name", WINDOWED)
def test_token_logps_match_transformers_shared_or_not_and_chunked(tmp_path, name):
    hf_model = _scaled_hf_folder(name, tmp_path)
    model, config = load_hf(tmp_path)
    batch = _batch(np.random.default_rng(5), config.vocab_size, b=4, p=10, c=9)
    want, scale = _hf_token_logps(hf_model, *batch)
    # float32 logits of either model may differ by the network's rounding bound; log_softmax at most doubles it
    tolerance = log_softmax_tolerance(decoder_tolerance(scale, config, batch[0].shape[1] + batch[2].shape[1]),
                                      config.vocab_size)
    # attention in one piece unshared, then in 3-row query chunks (rows cross the window edge) with the
    # prompt shared by groups of 2: two compiles, each feature in one of them (the other two pairings
    # added 20-25 s of compiles to the default tier and no path of their own)
    for chunk, group in ((None, 1), (3, 2)):
        model.attention_query_chunk = chunk
        graphdef, params = nnx.split(model)
        got = _jit_token_logps(graphdef, params, *(jnp.asarray(x) for x in batch), chunk_size=4, group_size=group)
        np.testing.assert_allclose(np.asarray(got), want, atol=tolerance, rtol=0, err_msg=f"chunk={chunk} G={group}")


@pytest.mark.parametrize("name, change", [
    ("mistral_window", dict(sliding_window=None, layer_types=None)),
    ("gemma2_softcap_tied", dict(layer_types=("full_attention",) * 3)),
    ("gemma2_softcap_tied", dict(attn_logit_softcapping=None)),
    ("gemma2_softcap_tied", dict(final_logit_softcapping=None)),
    ("gemma3_two_bases", dict(rope_local_theta=None)),
])
def test_each_feature_changes_the_logits(tmp_path, name, change):
    """The comparisons above have teeth: dropping any one feature moves the logits by far more than their
    tolerance (decoder_tolerance: ~1e-5 here)."""
    _scaled_hf_folder(name, tmp_path)
    model, config = load_hf(tmp_path)
    ablated = Decoder(dataclasses.replace(config, **change), rngs=nnx.Rngs(0))
    nnx.update(ablated, nnx.state(model))
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (2, 12))
    assert np.abs(rlbolt_logits(model, ids) - rlbolt_logits(ablated, ids)).max() > 1e-2


def test_linear_rope_divides_the_frequencies():
    base = rope_inv_freq(16, 10000.0, None)
    # a division by 4 is exact in binary floating point: bit equality
    np.testing.assert_array_equal(rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0}), base / 4)
    # float32 pow (NumPy's SIMD kernels differ by CPU, within a few ulps) against float64: 8 float32 ulps
    np.testing.assert_allclose(base, 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16), rtol=8 * EPS32)


_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 8}


@pytest.mark.parametrize("update, field", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4}, "use_sliding_window"),
    ({"architectures": ["MistralForCausalLM"], "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"}, "hidden_activation"),
    ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"architectures": ["Gemma3ForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": None}, "sliding_window"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForCausalLM"),
])
def test_fields_rlbolt_does_not_implement_are_refused_in_one_line(update, field):
    with pytest.raises(ValueError) as error:
        config_from_hf({**_LLAMA, **update}, "/m/config.json")
    message = str(error.value)
    assert field in message and "/m/config.json" in message and "\n" not in message


def test_gemma3_reads_legacy_rope_fields_and_default_pattern():
    hf = {**_LLAMA, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7, "head_dim": 4,
          "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
          "sliding_window": 512}
    config = config_from_hf(hf)
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling) == (
        1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    # transformers' default sliding_window_pattern of 6: every sixth layer is global.
    assert [config.is_sliding(i) for i in range(7)] == [True] * 5 + [False] + [True]
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 256 and config.qk_norm


@pytest.mark.parametrize("overrides, field", [
    (dict(layer_types=("sliding_attention",)), "layer_types"),
    (dict(layer_types=("sliding_attention", "full_attention")), "sliding_window"),
    (dict(layer_types=("local", "full_attention"), sliding_window=4), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "linear"}), "factor"),
])
def test_model_config_validates_family_fields(overrides, field):
    fields = dict(vocab_size=8, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4,
                  intermediate_size=8)
    with pytest.raises(ValueError, match=field):
        ModelConfig(**fields, **overrides).validate()


# Default tier: gemma3 and mistral; every family's bf16 cast is also in test_hf_checkpoint (slow: gemma2, MoE).
@pytest.mark.parametrize("name", [pytest.param("gemma2_softcap_tied", marks=pytest.mark.slow), "gemma3_two_bases",
                                  "mistral_window", pytest.param("qwen3_moe_top2", marks=pytest.mark.slow)])
def test_bfloat16_checkpoint_loads(tmp_path, name):
    """A checkpoint saved by transformers in bfloat16 loads as bfloat16, and as float32 with the logits
    of transformers' model on the same (bf16-rounded) weights."""
    hf_model = build_hf_model(name).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_hf(tmp_path)
    assert config.param_dtype == "bfloat16"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    wide, _ = load_hf(tmp_path, param_dtype="float32")
    ids = np.random.default_rng(4).integers(0, config.vocab_size, (2, 11))
    mask = np.ones(ids.shape, bool)
    mask[1, :5] = False
    # transformers re-read in float32 (a float() of the bf16 model would keep its bf16-rounded rope
    # and embedding-scale buffers).
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = hf_logits(reference, ids, mask)
    np.testing.assert_allclose(rlbolt_logits(wide, ids, mask)[mask], want[mask], rtol=0,
                               atol=decoder_tolerance(want[mask], config, ids.shape[1]))
    # The bf16 model itself runs (float32 logits) and stays close to the float32 one: bfloat16 rounding of
    # each stage's output, bf16_tolerance.
    low = rlbolt_logits(model, ids, mask)
    assert low.dtype == np.float32 and np.abs(low[mask] - want[mask]).max() < bf16_tolerance(want[mask], config)
