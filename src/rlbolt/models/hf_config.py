"""Hugging Face config.json <-> rlbolt ModelConfig, for Llama 3, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and Gemma 3.

Reads both transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling` fields,
and writes both, so files load in transformers 4.x and 5.x. Every field that changes the math
is read; a value the rlbolt decoder does not implement (an o_proj or MLP bias, another
activation, an unknown rope type, Qwen's per-layer sliding windows, bidirectional attention,
dropout) is refused with one line naming the file, the field and the fix, never loaded wrongly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlbolt.models.config import GEMMA_ARCHITECTURES, ROPE_TYPES, SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["config_from_hf", "config_to_hf", "CONFIG_FILE"]

CONFIG_FILE = "config.json"
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma2ForCausalLM": "gemma2",
                "Gemma3ForCausalLM": "gemma3_text"}
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}  # float16 is upcast
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' defaults


def _rope_from_params(params: Mapping[str, Any], theta_default: float, refuse) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one rope_parameters / rope_scaling dict, refusing what rlbolt lacks."""
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise refuse("rope_type", rope_type, f"rlbolt implements rope types {list(ROPE_TYPES)}")
    if float(scaling.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor", params["partial_rotary_factor"], "rlbolt rotates the whole head")
    theta = float(params.get("rope_theta", theta_default))
    return theta, (None if rope_type == "default" else scaling)


def _rope_from_hf(hf: Mapping[str, Any], refuse) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older files have rope_theta + rope_scaling.
    params = hf.get("rope_parameters")
    theta = hf.get("rope_theta", 10000.0)
    if isinstance(params, Mapping):
        return _rope_from_params(params, theta, refuse)
    return _rope_from_params({**(hf.get("rope_scaling") or {}), "rope_theta": theta}, theta, refuse)


def _gemma3_rope(hf: Mapping[str, Any], refuse) -> tuple[float, dict | None, float]:
    """Gemma 3: (global theta, global scaling, local theta); its sliding layers use default rope."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # older files: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq for local ones
        full = {**(hf.get("rope_scaling") or {})}
        if "rope_theta" in hf:
            full["rope_theta"] = hf["rope_theta"]
        local = {"rope_theta": hf["rope_local_base_freq"]} if "rope_local_base_freq" in hf else {}
    theta, scaling = _rope_from_params(full, _GEMMA3_THETA["full_attention"], refuse)
    local_theta, local_scaling = _rope_from_params(local, _GEMMA3_THETA["sliding_attention"], refuse)
    if local_scaling is not None:
        raise refuse("rope_parameters.sliding_attention", local_scaling,
                     "rlbolt's sliding layers use default rope at their own theta")
    return theta, scaling, local_theta


def _architecture(hf_config: Mapping[str, Any], path) -> str:
    architectures = hf_config.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:  # a bare config (e.g. `LlamaConfig().save_pretrained`) carries only its model_type
        by_type = {model_type: name for name, model_type in _MODEL_TYPES.items()}
        architecture = by_type.get(hf_config.get("model_type"), hf_config.get("model_type"))
    if architecture == "Gemma3ForConditionalGeneration":
        raise ValueError(f"{path}: architecture 'Gemma3ForConditionalGeneration' (the vision-language model) is not "
                         "supported; rlbolt loads Gemma 3 text checkpoints saved as Gemma3ForCausalLM.")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {architecture!r} (field \"architectures\") is not supported; "
            f"rlbolt loads {list(SUPPORTED_ARCHITECTURES)}."
        )
    return architecture


def _layer_types(hf_config, architecture: str, num_layers: int, refuse) -> tuple[int | None, tuple | None]:
    """(sliding_window, layer_types) as transformers builds them for this architecture."""
    window = hf_config.get("sliding_window")
    if architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        types = hf_config.get("layer_types")
        if hf_config.get("use_sliding_window", False) or (types and "sliding_attention" in types):
            raise refuse("use_sliding_window", hf_config.get("use_sliding_window"),
                         "Qwen's sliding windows over layers >= max_window_layers are not implemented; set it to false")
        return None, None
    if architecture == "MistralForCausalLM":
        if hf_config.get("layer_types"):
            raise refuse("layer_types", hf_config["layer_types"],
                         "Mistral windows every layer (transformers ignores per-layer types here); remove the field")
        return (None, None) if window is None else (int(window), ("sliding_attention",) * num_layers)
    # Gemma 2 alternates local/global from layer 0; Gemma 3 makes every `sliding_window_pattern`-th layer global.
    types = hf_config.get("layer_types")
    if not types:
        pattern = 2 if architecture == "Gemma2ForCausalLM" else int(hf_config.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = tuple(types)
    if "sliding_attention" not in types:
        return (None if window is None else int(window)), types
    if window is None:
        raise refuse("sliding_window", None, "layer_types has sliding_attention layers; give the window")
    return int(window), types


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
    architecture = _architecture(hf_config, path)
    gemma = architecture in GEMMA_ARCHITECTURES

    def refuse(field: str, value: Any, why: str):
        return ValueError(f"{path}: {field}={value!r} is not supported for {architecture}: {why}.")

    def unsupported(field: str, why: str):
        return refuse(field, hf_config.get(field), why)

    act_field = "hidden_activation" if gemma and hf_config.get("hidden_activation") else "hidden_act"
    hidden_act = hf_config.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
    if hidden_act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise unsupported(act_field, "rlbolt's gated MLP uses silu (gelu_pytorch_tanh for Gemma)")
    if hf_config.get("mlp_bias", False):
        raise unsupported("mlp_bias", "the rlbolt MLP has no bias")
    if architecture == "Qwen2ForCausalLM":
        attention_bias = True  # Qwen2 always has q/k/v bias and no o_proj bias
    elif hf_config.get("attention_bias", False):
        raise unsupported("attention_bias", "it also adds an o_proj bias, which rlbolt lacks")
    else:
        attention_bias = False
    if float(hf_config.get("attention_dropout") or 0.0) != 0.0:
        raise unsupported("attention_dropout", "rlbolt has no dropout; set it to 0.0")
    if hf_config.get("use_bidirectional_attention"):
        raise unsupported("use_bidirectional_attention", "rlbolt's attention is causal; set it to false")
    if not gemma:
        for field in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            if hf_config.get(field) is not None:
                raise unsupported(field, "only Gemma 2 / 3 have it in transformers; remove the field")
    elif architecture == "Gemma3ForCausalLM" and hf_config.get("attn_logit_softcapping") is not None:
        raise unsupported("attn_logit_softcapping", "transformers' Gemma 3 ignores it; set it to null")

    num_heads = int(hf_config["num_attention_heads"])
    hidden_size = int(hf_config["hidden_size"])
    num_layers = int(hf_config["num_hidden_layers"])
    if param_dtype is None:
        file_dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
        if file_dtype not in _HF_DTYPES:
            raise unsupported("dtype", f"use one of {sorted(_HF_DTYPES)} or pass param_dtype")
        param_dtype = _HF_DTYPES[file_dtype]
    local_theta = None
    if architecture == "Gemma3ForCausalLM":
        rope_theta, rope_scaling, local_theta = _gemma3_rope(hf_config, refuse)
    else:
        rope_theta, rope_scaling = _rope_from_hf(hf_config, refuse)
    sliding_window, layer_types = _layer_types(hf_config, architecture, num_layers, refuse)
    head_dim = int(hf_config.get("head_dim") or hidden_size // num_heads)
    gemma_fields, moe_fields = {}, {}
    if architecture == "Qwen3MoeForCausalLM":
        moe_fields = dict(
            # transformers 5 writes num_local_experts; older files num_experts.
            num_experts=int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0),
            num_experts_per_tok=int(hf_config.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(hf_config.get("moe_intermediate_size", 0)),
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf_config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in hf_config.get("mlp_only_layers") or ()))
    if gemma:
        gemma_fields = dict(
            norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True,
            query_pre_attn_scalar=float(hf_config.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=hf_config.get("attn_logit_softcapping"),
            final_logit_softcapping=hf_config.get("final_logit_softcapping"),
            rope_local_theta=local_theta)
    config = ModelConfig(
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        intermediate_size=int(hf_config["intermediate_size"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
        param_dtype=param_dtype,
        architecture=architecture,
        hidden_act=hidden_act,
        sliding_window=sliding_window,
        layer_types=layer_types,
        **gemma_fields,
        **moe_fields,
    )
    try:
        return config.validate()
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def _check_expressible(config: ModelConfig) -> None:
    """Refuses configs whose feature set no Hugging Face architecture has."""
    arch = config.architecture
    gemma = arch in GEMMA_ARCHITECTURES
    if config.attention_bias and arch != "Qwen2ForCausalLM":
        raise ValueError(
            f"ModelConfig.attention_bias=True with architecture={arch!r} has no Hugging Face "
            "equivalent (only Qwen2 has q/k/v bias without o_proj bias); use Qwen2ForCausalLM."
        )
    if config.qk_norm != (arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")):
        raise ValueError(
            f"ModelConfig.qk_norm={config.qk_norm} does not match architecture={arch!r}: "
            "q/k norm exists exactly in Qwen3ForCausalLM, Qwen3MoeForCausalLM and Gemma3ForCausalLM."
        )
    if (config.num_experts > 0) != (arch == "Qwen3MoeForCausalLM"):
        raise ValueError(f"ModelConfig.num_experts={config.num_experts} does not match architecture={arch!r}: "
                         "rlbolt writes mixtures of experts as Qwen3MoeForCausalLM.")
    wanted = dict(norm_unit_offset=gemma, sandwich_norms=gemma, scale_embeddings=gemma,
                  hidden_act="gelu_pytorch_tanh" if gemma else "silu")
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise ValueError(f"ModelConfig.{field}={getattr(config, field)!r} does not match architecture={arch!r}, "
                             f"which has {value!r}.")
    if not gemma:
        for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            if getattr(config, field) is not None:
                raise ValueError(f"ModelConfig.{field} is set but architecture={arch!r} lacks it; use a Gemma one.")
    if arch == "Gemma3ForCausalLM" and config.attn_logit_softcapping is not None:
        raise ValueError("ModelConfig.attn_logit_softcapping is set but transformers' Gemma 3 ignores it; use Gemma 2.")
    sliding = config.layer_types is not None and "sliding_attention" in config.layer_types
    if sliding and arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        raise ValueError(f"ModelConfig.layer_types has sliding layers; architecture={arch!r} cannot express them here.")
    if sliding and arch == "MistralForCausalLM" and set(config.layer_types) != {"sliding_attention"}:
        raise ValueError("ModelConfig.layer_types: MistralForCausalLM windows every layer or none.")


def _int_if_whole(value: float | None):
    # transformers' strict Gemma configs type query_pre_attn_scalar as int.
    return int(value) if value is not None and float(value).is_integer() else value


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json dict that transformers (4.x and 5.x) loads for this model.

    Args:
        config: the rlbolt config.

    Returns:
        A JSON-serialisable dict with `architectures`, `model_type`, `dtype`/`torch_dtype`.
    """
    config.validate()
    _check_expressible(config)
    arch = config.architecture
    rope_scaling = dict(config.rope_scaling) if config.rope_scaling else None
    hf = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta/rope_scaling.
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_theta": config.rope_theta, **(rope_scaling or {"rope_type": "default"})},
        "dtype": config.param_dtype,
        "torch_dtype": config.param_dtype,
        "attention_dropout": 0.0,
    }
    if arch in GEMMA_ARCHITECTURES:
        sliding = config.layer_types or ("full_attention",) * config.num_layers
        hf.update(hidden_activation=config.hidden_act, hidden_act=config.hidden_act, attention_bias=False,
                  query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
                  attn_logit_softcapping=config.attn_logit_softcapping,
                  final_logit_softcapping=config.final_logit_softcapping,
                  sliding_window=config.sliding_window or config.max_position_embeddings,
                  layer_types=list(sliding))
        if arch == "Gemma3ForCausalLM":
            local_theta = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
            hf["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
            hf["rope_local_base_freq"] = local_theta
        return hf
    hf["hidden_act"] = config.hidden_act
    if arch != "Qwen2ForCausalLM":
        hf["attention_bias"] = False
        hf["mlp_bias"] = False
    if arch == "Qwen3MoeForCausalLM":
        hf.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                  moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                  decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers))
    if arch == "MistralForCausalLM":
        hf["sliding_window"] = config.sliding_window
    elif arch != "LlamaForCausalLM":
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
    return hf
