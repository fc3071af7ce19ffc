"""config.json <-> ModelConfig, plus the tiny transformers models shared by the other test_hf_* files."""

import json

import numpy as np
import pytest
import torch
import transformers

from rlbolt.models.config import ModelConfig
from rlbolt.models.hf_io import config_from_hf, config_to_hf
from rollout_jit import forward_logits

_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, intermediate_size=48,
               max_position_embeddings=128, rms_norm_eps=1e-5)

# name -> (transformers config class, kwargs); each case exercises one family-specific feature.
FAMILIES = {
    "llama_gqa_untied": (transformers.LlamaConfig, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)),
    "llama32_tied_rope_scaling": (transformers.LlamaConfig, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    "qwen2_bias": (transformers.Qwen2Config, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen3_qk_norm": (transformers.Qwen3Config, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    # Windows of a few tokens so that the tests' prompts (5 to 14 tokens) and completions cross them.
    "mistral_window": (transformers.MistralConfig, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0, sliding_window=4,
        tie_word_embeddings=False)),
    "gemma2_softcap_tied": (transformers.Gemma2Config, dict(
        _COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        tie_word_embeddings=True)),
    "gemma2_nocap_untied": (transformers.Gemma2Config, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=6, attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=False)),
    "gemma3_two_bases": (transformers.Gemma3TextConfig, dict(
        _COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        query_pre_attn_scalar=8, sliding_window=4, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})),
    # Mixtures of 4 experts: top-2 renormalised with a dense layer 1, and top-1 unnormalised (tied).
    "qwen3_moe_top2": (transformers.Qwen3MoeConfig, dict(
        _COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1],
        tie_word_embeddings=False)),
    "qwen3_moe_top1": (transformers.Qwen3MoeConfig, dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=1,
        moe_intermediate_size=16, norm_topk_prob=False, tie_word_embeddings=True)),
}
MODEL_CLASSES = {transformers.LlamaConfig: transformers.LlamaForCausalLM,
                 transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
                 transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
                 transformers.MistralConfig: transformers.MistralForCausalLM,
                 transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
                 transformers.Gemma3TextConfig: transformers.Gemma3ForCausalLM,
                 transformers.Qwen3MoeConfig: transformers.Qwen3MoeForCausalLM}


def build_hf_model(name: str, seed: int = 0):
    """A float32 transformers model with random weights, including norms and biases (not just ones/zeros)."""
    config_class, kwargs = FAMILIES[name]
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config_class](config_class(**kwargs)).to(torch.float32).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0, which would hide mapping bugs
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param_name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def hf_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """[B, T] ids (and optional [B, T] mask, left padded) -> [B, T, V] float32 logits from transformers."""
    kwargs = {}
    if attention_mask is not None:
        mask = torch.from_numpy(attention_mask.astype(np.int64))
        kwargs["attention_mask"] = mask
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(input_ids.astype(np.int64)), **kwargs).logits.float().numpy()


def rlbolt_logits(model, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """The same forward through an rlbolt Decoder (positions = cumsum(mask) - 1 for left padding), jitted as
    the trainer runs it: one compiled program per model structure and shape, not one per primitive."""
    if attention_mask is None:
        attention_mask = np.ones_like(input_ids, dtype=bool)
    positions = np.clip(np.cumsum(attention_mask, axis=-1) - 1, 0, None).astype(np.int32)
    return np.asarray(forward_logits(model, input_ids.astype(np.int32), positions, attention_mask.astype(bool)))


def _saved_config(tmp_path, name) -> dict:
    config_class, kwargs = FAMILIES[name]
    config_class(**kwargs).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


EXPECTED = {  # independent of the converter: read off the kwargs above and HF's family conventions
    "llama_gqa_untied": dict(num_kv_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=False,
                             qk_norm=False, rope_scaling=None, rope_theta=10000.0),
    "llama32_tied_rope_scaling": dict(num_kv_heads=1, head_dim=8, tie_word_embeddings=True, attention_bias=False,
                                      qk_norm=False, rope_theta=500000.0,
                                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2_bias": dict(num_kv_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=True, qk_norm=False,
                       rope_scaling=None, rope_theta=1000000.0),
    "qwen3_qk_norm": dict(num_kv_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=False,
                          qk_norm=True, rope_scaling=None, rope_theta=1000000.0),
    "mistral_window": dict(num_kv_heads=2, head_dim=8, tie_word_embeddings=False, qk_norm=False, rope_scaling=None,
                           sliding_window=4, layer_types=("sliding_attention",) * 2, hidden_act="silu",
                           norm_unit_offset=False, sandwich_norms=False, final_logit_softcapping=None),
    "gemma2_softcap_tied": dict(num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=False,
                                rope_scaling=None, rope_theta=10000.0, rope_local_theta=None, sliding_window=4,
                                layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                                hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, sandwich_norms=True,
                                scale_embeddings=True, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                final_logit_softcapping=3.0),
    "gemma2_nocap_untied": dict(num_kv_heads=1, head_dim=16, tie_word_embeddings=False, query_pre_attn_scalar=24,
                                sliding_window=6, attn_logit_softcapping=None, final_logit_softcapping=None,
                                layer_types=("sliding_attention", "full_attention")),
    "gemma3_two_bases": dict(num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=True,
                             rope_theta=1000000.0, rope_scaling=dict(rope_type="linear", factor=2.0),
                             rope_local_theta=10.0, sliding_window=4, query_pre_attn_scalar=8,
                             layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                             attn_logit_softcapping=None, final_logit_softcapping=None, sandwich_norms=True),
    "qwen3_moe_top2": dict(qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           norm_topk_prob=True, mlp_only_layers=(1,), decoder_sparse_step=1, tie_word_embeddings=False),
    "qwen3_moe_top1": dict(qk_norm=True, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
                           mlp_only_layers=(), tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_from_hf_maps_each_family(tmp_path, name):
    config = config_from_hf(_saved_config(tmp_path, name))
    for field, value in EXPECTED[name].items():
        assert getattr(config, field) == value, field
    assert (config.vocab_size, config.hidden_size, config.num_heads) == (96, 32, 4)
    assert config.num_layers == FAMILIES[name][1]["num_hidden_layers"]
    assert (config.intermediate_size, config.rms_norm_eps, config.param_dtype) == (48, 1e-5, "float32")


def test_config_from_legacy_rope_fields():
    # Hub files written before transformers 5 use rope_theta + rope_scaling (with "type" in old ones).
    legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 8, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
              "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    config = config_from_hf(legacy)
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    assert (config.num_kv_heads, config.head_dim, config.param_dtype) == (2, 4, "bfloat16")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_round_trips_through_transformers(tmp_path, name):
    config = config_from_hf(_saved_config(tmp_path, name))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config)))
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(reloaded) is FAMILIES[name][0]
    assert config_from_hf(reloaded.to_dict()) == config


def test_unknown_architecture_names_file_and_supported_list():
    with pytest.raises(ValueError) as error:
        config_from_hf({"architectures": ["GPT2LMHeadModel"]}, "/m/config.json")
    message = str(error.value)
    assert "/m/config.json" in message and "GPT2LMHeadModel" in message and "Qwen3ForCausalLM" in message


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True)])
def test_unsupported_features_are_refused(field, value):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 8, field: value}
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf)


def test_config_to_hf_refuses_features_hf_cannot_express():
    config = ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
                         intermediate_size=8, attention_bias=True, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match="attention_bias"):
        config_to_hf(config)
