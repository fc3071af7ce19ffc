"""Model configuration for the rlbolt decoder families (Llama 3, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3")
_PARAM_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Field names follow Hugging Face's config.json where one exists, so a reader can map them
    one to one (the HF converter lives in `rlbolt.models.hf_io`).

    Attributes:
        vocab_size: number of token ids V.
        hidden_size: residual width H.
        num_layers: number of decoder blocks (HF `num_hidden_layers`).
        num_heads: query heads nH (HF `num_attention_heads`).
        num_kv_heads: key/value heads nKV for grouped-query attention; divides num_heads.
        head_dim: per-head width D (need not equal H / nH; Qwen3 sets it explicitly).
        intermediate_size: gated MLP hidden width I.
        rope_theta: RoPE base.
        rope_scaling: HF's `rope_scaling` dict or None. Supported: None, `{"rope_type": "default"}`,
            `{"rope_type": "linear", "factor"}` and `{"rope_type": "llama3", "factor", "low_freq_factor",
            "high_freq_factor", "original_max_position_embeddings"}`.
        rms_norm_eps: epsilon inside RMSNorm's rsqrt.
        tie_word_embeddings: if True the output projection reuses `embed.embedding` (no lm_head).
        attention_bias: bias on the fused q/k/v projection (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        max_position_embeddings: longest sequence (prompt + completion) the sampler accepts.
        param_dtype: "float32" or "bfloat16"; norms, RoPE, softmax and logits compute in float32.
        architecture: the HF architecture name this config mirrors.
        hidden_act: the gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
        norm_unit_offset: RMSNorm scales by `1 + weight` with weights stored centred on 0 (Gemma).
        sandwich_norms: RMSNorm also after attention and after the MLP, before each residual add
            (Gemma's post_attention_layernorm / post_feedforward_layernorm).
        scale_embeddings: embeddings are multiplied by sqrt(hidden_size) (Gemma).
        query_pre_attn_scalar: attention scores are scaled by `query_pre_attn_scalar ** -0.5`;
            None: `head_dim ** -0.5`.
        attn_logit_softcapping: None, or c for scores `c * tanh(scores / c)` before the mask (Gemma 2).
        final_logit_softcapping: None, or c for logits `c * tanh(logits / c)` (Gemma 2).
        sliding_window: W, the keys a sliding layer's query sees: itself and the W - 1 before it.
        layer_types: one of "full_attention" / "sliding_attention" per layer; None: all full.
        rope_local_theta: RoPE base of the sliding layers (Gemma 3's rope_local_base_freq, default
            rope there); None: sliding layers use `rope_theta` and `rope_scaling` like the others.
        num_experts: E experts in each MoE layer (Qwen3-MoE); 0: every MLP is dense.
        num_experts_per_tok: k experts per token.
        moe_intermediate_size: each expert's SwiGLU width.
        norm_topk_prob: renormalise the k routing probabilities to sum to 1.
        decoder_sparse_step: layer i is MoE when (i + 1) % step == 0 (and not in mlp_only_layers).
        mlp_only_layers: layers kept dense.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    param_dtype: str = "float32"
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __hash__(self):
        # rope_scaling is a dict (unhashable); hash its items so configs can be static jit args.
        scaling = tuple(sorted((self.rope_scaling or {}).items()))
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_scaling")
        return hash((fields, scaling))

    @property
    def dtype(self):
        """The jnp dtype of the parameters."""
        return _PARAM_DTYPES[self.param_dtype]

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_scale(self) -> float:
        """The factor on q . k: `query_pre_attn_scalar ** -0.5`, by default `head_dim ** -0.5`."""
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def validate(self) -> "ModelConfig":
        """Checks every field; returns self so calls can chain.

        Raises:
            ValueError: naming the offending field, its value and the fix.
        """
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                  "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                    f"ModelConfig.num_heads={self.num_heads} is not divisible by "
                    f"num_kv_heads={self.num_kv_heads}; grouped-query attention needs num_heads to be a "
                    "multiple of num_kv_heads.")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta={self.rope_theta} must be > 0.")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps} must be > 0.")
        if self.param_dtype not in _PARAM_DTYPES:
            raise ValueError(f"ModelConfig.param_dtype={self.param_dtype!r}; use one of {sorted(_PARAM_DTYPES)}.")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"ModelConfig.architecture={self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}.")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            needed = {"default": (), "linear": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
            if rope_type not in needed:
                raise ValueError(
                        f"ModelConfig.rope_scaling rope_type={rope_type!r} is not supported; use None or one of "
                        f"{list(needed)}.")
            missing = [k for k in needed[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"ModelConfig.rope_scaling ({rope_type}) is missing keys {missing}; it needs "
                                 f"{needed[rope_type]}.")
            if rope_type == "llama3" and self.rope_scaling["high_freq_factor"] == self.rope_scaling["low_freq_factor"]:
                raise ValueError("ModelConfig.rope_scaling: high_freq_factor must differ from low_freq_factor.")
            if rope_type != "default" and not float(self.rope_scaling["factor"]) > 0:
                raise ValueError(f"ModelConfig.rope_scaling factor={self.rope_scaling['factor']!r} must be > 0.")
        self._validate_family_fields()
        return self

    def _validate_family_fields(self) -> None:
        """Checks the fields beyond the Llama core (activation, norms, soft-capping, windows)."""
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act={self.hidden_act!r}; use one of {HIDDEN_ACTS}.")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and value > 0):
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive number or None.")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window={self.sliding_window!r} must be a positive int or None.")
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int when num_experts > 0.")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                                 f"num_experts={self.num_experts}; choose k <= E.")
            if not isinstance(self.mlp_only_layers, tuple):
                raise ValueError(f"ModelConfig.mlp_only_layers={self.mlp_only_layers!r} must be a tuple of layer "
                                 "indices.")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types must be a tuple of num_layers={self.num_layers} entries; "
                                 f"got {self.layer_types!r}.")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"ModelConfig.layer_types has unknown entries {unknown}; use {LAYER_TYPES}.")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window=None; "
                                 "set sliding_window.")
        return self


def tiny_config(**overrides: Any) -> ModelConfig:
    """A tiny random-init config for tests and demos (vocab 256, hidden 64, 2 layers, GQA 4/2).

    Args:
        **overrides: any ModelConfig field.

    Returns:
        A validated ModelConfig.
    """
    fields = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=16, intermediate_size=128, max_position_embeddings=512)
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def workload_config(**overrides: Any) -> ModelConfig:
    """The benchmark model of benchmarks/WORKLOAD.md (Llama-style, ~3.4M params, float32).

    Args:
        **overrides: any ModelConfig field.

    Returns:
        A validated ModelConfig.
    """
    fields = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                head_dim=64, intermediate_size=704, rope_theta=10000.0, max_position_embeddings=512,
                                tie_word_embeddings=False, param_dtype="float32", architecture="LlamaForCausalLM")
    fields.update(overrides)
    return ModelConfig(**fields).validate()
