"""Hugging Face config.json <-> rlbolt ModelConfig, for Llama 3, Qwen2/2.5 and Qwen3.

Reads both transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling` fields,
and writes both, so files load in transformers 4.x and 5.x. Features the rlbolt decoder lacks
(o_proj or MLP bias, sliding windows, non-silu activations) are refused with an error naming the
file and field rather than loaded wrongly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlbolt.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["config_from_hf", "config_to_hf", "CONFIG_FILE"]

CONFIG_FILE = "config.json"
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}  # float16 is upcast


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older files have rope_theta + rope_scaling.
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping):
        scaling = {key: value for key, value in params.items() if key != "rope_theta"}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        scaling = dict(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", 10000.0)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def config_from_hf(
    hf_config: Mapping[str, Any], path: str | os.PathLike = CONFIG_FILE, *, param_dtype: str | None = None
) -> ModelConfig:
    """Maps a Hugging Face config.json dict to a ModelConfig.

    Args:
        hf_config: the parsed config.json.
        path: where it came from, for error messages.
        param_dtype: "float32" or "bfloat16"; None takes the file's `dtype`/`torch_dtype`
            (float16 checkpoints load as float32), defaulting to float32.

    Returns:
        A validated ModelConfig.

    Raises:
        ValueError: unsupported architecture or feature, naming the file and the field.
    """
    architectures = hf_config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:  # a bare config (e.g. `LlamaConfig().save_pretrained`) carries only its model_type
        by_type = {model_type: name for name, model_type in _MODEL_TYPES.items()}
        architecture = by_type.get(hf_config.get("model_type"), hf_config.get("model_type"))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {architecture!r} (field \"architectures\") is not supported; "
            f"rlbolt loads {list(SUPPORTED_ARCHITECTURES)}."
        )

    def unsupported(field: str, why: str):
        return ValueError(f"{path}: {field}={hf_config.get(field)!r} is not supported for {architecture}: {why}.")

    if hf_config.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", "the rlbolt decoder uses a SwiGLU MLP with silu")
    if hf_config.get("mlp_bias", False):
        raise unsupported("mlp_bias", "the rlbolt MLP has no bias")
    if architecture == "Qwen2ForCausalLM":
        attention_bias = True  # Qwen2 always has q/k/v bias and no o_proj bias
    elif hf_config.get("attention_bias", False):
        raise unsupported("attention_bias", "Llama/Qwen3 attention_bias also adds an o_proj bias, which rlbolt lacks")
    else:
        attention_bias = False
    if hf_config.get("use_sliding_window", False):
        raise unsupported("use_sliding_window", "rlbolt attends over the full context; set it to false")

    num_heads = int(hf_config["num_attention_heads"])
    hidden_size = int(hf_config["hidden_size"])
    if param_dtype is None:
        file_dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
        if file_dtype not in _HF_DTYPES:
            raise unsupported("dtype", f"use one of {sorted(_HF_DTYPES)} or pass param_dtype")
        param_dtype = _HF_DTYPES[file_dtype]
    rope_theta, rope_scaling = _rope_from_hf(hf_config)
    config = ModelConfig(
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=int(hf_config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
        head_dim=int(hf_config.get("head_dim") or hidden_size // num_heads),
        intermediate_size=int(hf_config["intermediate_size"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=architecture == "Qwen3ForCausalLM",
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
        param_dtype=param_dtype,
        architecture=architecture,
    )
    try:
        return config.validate()
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json dict that transformers (4.x and 5.x) loads for this model.

    Args:
        config: the rlbolt config.

    Returns:
        A JSON-serialisable dict with `architectures`, `model_type`, `dtype`/`torch_dtype`.
    """
    config.validate()
    if config.attention_bias and config.architecture != "Qwen2ForCausalLM":
        raise ValueError(
            f"ModelConfig.attention_bias=True with architecture={config.architecture!r} has no Hugging Face "
            "equivalent (only Qwen2 has q/k/v bias without o_proj bias); use Qwen2ForCausalLM."
        )
    if config.qk_norm != (config.architecture == "Qwen3ForCausalLM"):
        raise ValueError(
            f"ModelConfig.qk_norm={config.qk_norm} does not match architecture={config.architecture!r}: "
            "q/k norm exists exactly in Qwen3ForCausalLM."
        )
    rope_scaling = dict(config.rope_scaling) if config.rope_scaling else None
    hf = {
        "architectures": [config.architecture],
        "model_type": _MODEL_TYPES[config.architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta/rope_scaling.
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_theta": config.rope_theta, **(rope_scaling or {"rope_type": "default"})},
        "dtype": config.param_dtype,
        "torch_dtype": config.param_dtype,
    }
    if config.architecture != "Qwen2ForCausalLM":
        hf["attention_bias"] = False
        hf["mlp_bias"] = False
    if config.architecture != "LlamaForCausalLM":
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
    return hf
