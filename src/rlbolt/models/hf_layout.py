"""Which Hugging Face tensors make each rlbolt parameter: the one name / split / transpose mapping
that the safetensors reader and writer (`hf_io`), the GGUF reader (`gguf_io`) and the vLLM weight
push (`rollout.vllm_engine`) share."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlbolt.models.config import ModelConfig
from rlbolt.models.stacked_layers import flat_layer_slices

__all__ = ["HfTensor", "flat_params", "hf_tensor_layout", "split_sizes"]

@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One rlbolt parameter and the HF tensors it is made of (concatenated along HF's axis 0)."""

    sources: tuple[str, ...]
    transpose: bool  # HF Linear [out, in] -> kernel [in, out]
    experts: int = 0  # > 0: sources are expert-major, each expert's part built as above, stacked on axis 0


def hf_tensor_layout(config: ModelConfig) -> dict[str, HfTensor]:
    """Which Hugging Face tensors make each rlbolt parameter.

    Args:
        config: the model config.

    Returns:
        {rlbolt parameter path ("layers.0.attn.qkv_proj.kernel"): its HF sources}.
    """
    layout = {"embed.embedding": HfTensor(("model.embed_tokens.weight",), False),
              "final_norm.scale": HfTensor(("model.norm.weight",), False)}
    if not config.tie_word_embeddings:
        layout["lm_head.kernel"] = HfTensor(("lm_head.weight",), True)
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        attn = f"{hf}.self_attn"
        layout[f"{ours}.attn_norm.scale"] = HfTensor((f"{hf}.input_layernorm.weight",), False)
        if config.sandwich_norms:  # Gemma: post_attention_layernorm is the norm after attention
            layout[f"{ours}.post_attn_norm.scale"] = HfTensor((f"{hf}.post_attention_layernorm.weight",), False)
            layout[f"{ours}.mlp_norm.scale"] = HfTensor((f"{hf}.pre_feedforward_layernorm.weight",), False)
            layout[f"{ours}.post_mlp_norm.scale"] = HfTensor((f"{hf}.post_feedforward_layernorm.weight",), False)
        else:
            layout[f"{ours}.mlp_norm.scale"] = HfTensor((f"{hf}.post_attention_layernorm.weight",), False)
        qkv = tuple(f"{attn}.{name}_proj" for name in "qkv")
        layout[f"{ours}.attn.qkv_proj.kernel"] = HfTensor(tuple(f"{p}.weight" for p in qkv), True)
        if config.attention_bias:
            layout[f"{ours}.attn.qkv_proj.bias"] = HfTensor(tuple(f"{p}.bias" for p in qkv), False)
        if config.qk_norm:
            layout[f"{ours}.attn.q_norm.scale"] = HfTensor((f"{attn}.q_norm.weight",), False)
            layout[f"{ours}.attn.k_norm.scale"] = HfTensor((f"{attn}.k_norm.weight",), False)
        layout[f"{ours}.attn.o_proj.kernel"] = HfTensor((f"{attn}.o_proj.weight",), True)
        if config.is_moe(i):  # HF files keep one gate/up/down Linear per expert
            experts = [f"{hf}.mlp.experts.{e}" for e in range(config.num_experts)]
            layout[f"{ours}.mlp.router_kernel"] = HfTensor((f"{hf}.mlp.gate.weight",), True)
            layout[f"{ours}.mlp.gate_up"] = HfTensor(
                tuple(f"{x}.{name}_proj.weight" for x in experts for name in ("gate", "up")), True, config.num_experts)
            layout[f"{ours}.mlp.down"] = HfTensor(tuple(f"{x}.down_proj.weight" for x in experts), True,
                                                 config.num_experts)
            continue
        layout[f"{ours}.mlp.gate_up_proj.kernel"] = HfTensor(
            (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), True)
        layout[f"{ours}.mlp.down_proj.kernel"] = HfTensor((f"{hf}.mlp.down_proj.weight",), True)
    return layout


def split_sizes(path: str, config: ModelConfig, count: int, total: int) -> list[int]:
    """The sizes along HF's axis 0 of the `count` tensors a fused rlbolt parameter of `total` rows
    splits into: q|k|v by the head sizes, gate|up (and experts) in equal parts."""
    if count == 1:
        return [total]
    if "qkv_proj" in path:
        return [config.q_size, config.kv_size, config.kv_size]
    return [total // count] * count  # gate|up halves


def flat_params(state) -> dict[str, Any]:
    """An nnx state as {"layers.0.attn.qkv_proj.kernel": variable}: the layout's keys.

    Layers stored stacked (`rlbolt.models.stacked_layers`) come out per layer as read-only
    `LayerSlice`s (`get_value()` slices one layer when read); per-layer states give their own
    variables (the loaders set them)."""
    return {".".join(str(part) for part in path): variable for path, variable in flat_layer_slices(state)}
