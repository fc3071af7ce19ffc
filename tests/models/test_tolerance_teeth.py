"""The derived tolerances (tests/float_tolerance.py) are not loose: the model comparisons that use them
fail when one weight is wrong by the size of a real bug, for the three kinds of comparison that
broke across CPUs: a GGUF file against its de-quantised weights, rlbolt against transformers, and
LoRA's merged kernels against the adapted model. Each case also checks the correct model passes,
so both sides of the bound are exercised on the same inputs."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from float_tolerance import decoder_tolerance
from models.test_hf_config import build_hf_model, hf_logits, rlbolt_logits

from rlbolt.models import Decoder, tiny_config
from rlbolt.models.hf_io import load_hf
from rlbolt.models.lora import LoraConfig, apply_lora, merge_adapters

gguf = pytest.importorskip("gguf")
from models.test_gguf import _ids, reference_model, write_gguf  # noqa: E402
from models.test_gguf import build_family_model as build_gguf_family  # noqa: E402


def _sign_flipped(weight: np.ndarray, row: int = 0) -> np.ndarray:
    """The weight with its largest value in `row` negated: one value decoded with the wrong sign."""
    bad = weight.copy()
    column = np.argmax(np.abs(bad[row]))
    bad[row, column] = -bad[row, column]
    return bad


def test_gguf_comparison_fails_for_one_wrongly_decoded_value(tmp_path):
    from gguf import GGMLQuantizationType as Q

    name = "llama_gqa_untied"
    expected = write_gguf(tmp_path / "m.gguf", name, build_gguf_family(name), Q.Q6_K)
    from rlbolt.models.gguf_io import load_gguf_model

    ours, config = load_gguf_model(tmp_path / "m.gguf", param_dtype="float32")
    ids, mask = _ids(config.vocab_size)
    got = rlbolt_logits(ours, ids, mask)[mask]
    right = hf_logits(reference_model(name, expected), ids, mask)[mask]
    tolerance = decoder_tolerance(right, config, ids.shape[1])
    assert np.abs(got - right).max() <= tolerance
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        wrong = hf_logits(reference_model(name, {**expected, key: _sign_flipped(expected[key])}), ids, mask)[mask]
        assert np.abs(got - wrong).max() > 3 * tolerance, key


def test_transformers_comparison_fails_for_two_swapped_rows(tmp_path):
    """A wrong q/k row order (the bug llama.cpp's interleave invites): two adjacent q rows swapped."""
    hf = build_hf_model("qwen2_bias")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours, config = load_hf(tmp_path)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
    mask = np.ones(ids.shape, bool)
    right = hf_logits(hf, ids, mask)
    got = rlbolt_logits(ours, ids, mask)
    tolerance = decoder_tolerance(right, config, ids.shape[1])
    assert np.abs(got - right).max() <= tolerance
    with torch.no_grad():
        q = hf.model.layers[1].self_attn.q_proj.weight
        q[[0, 1]] = q[[1, 0]]
    wrong = hf_logits(hf, ids, mask)
    assert np.abs(got - wrong).max() > 3 * tolerance


def test_lora_comparison_fails_for_one_wrong_merged_value():
    """The merged model against the adapted one, with one merged kernel value off by 2% of that
    kernel's largest value (an adapter product added to the wrong column would be far larger)."""
    config = tiny_config(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=96)
    adapted = apply_lora(Decoder(config, rngs=nnx.Rngs(0)), LoraConfig(rank=4, alpha=16, targets=("q", "down")),
                         rngs=nnx.Rngs(1))
    for path, value in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam)):
        value.set_value(0.2 * jnp.asarray(np.random.default_rng(len(path)).standard_normal(value.shape), jnp.float32))
    merged = merge_adapters(adapted)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 40, (2, 7)), jnp.int32)
    mask = np.ones(ids.shape, bool)
    want = rlbolt_logits(adapted, np.asarray(ids), mask)
    tolerance = decoder_tolerance(want, config, 7, adapter_rank=4)
    assert np.abs(rlbolt_logits(merged, np.asarray(ids), mask) - want).max() <= tolerance
    kernel = merged.layers[1].mlp.down_proj.kernel
    bad = np.asarray(kernel.get_value()).copy()
    bad[0, 0] += 0.02 * np.abs(bad).max()
    kernel.set_value(jnp.asarray(bad))
    assert np.abs(rlbolt_logits(merged, np.asarray(ids), mask) - want).max() > 3 * tolerance
