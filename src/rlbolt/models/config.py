"""Model configuration for the rlbolt decoder family (Llama 3, Qwen2/2.5, Qwen3)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
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
        intermediate_size: SwiGLU hidden width I.
        rope_theta: RoPE base.
        rope_scaling: HF's `rope_scaling` dict or None. Supported: None, `{"rope_type": "default"}`
            and `{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}`.
        rms_norm_eps: epsilon inside RMSNorm's rsqrt.
        tie_word_embeddings: if True the output projection reuses `embed.embedding` (no lm_head).
        attention_bias: bias on the fused q/k/v projection (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        max_position_embeddings: longest sequence (prompt + completion) the sampler accepts.
        param_dtype: "float32" or "bfloat16"; norms, RoPE, softmax and logits compute in float32.
        architecture: the HF architecture name this config mirrors.
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

    def __hash__(self):
        # rope_scaling is a dict (unhashable); hash its items so configs can be static jit args.
        scaling = tuple(sorted((self.rope_scaling or {}).items()))
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "rope_scaling")
        return hash((fields, scaling))

    @property
    def dtype(self):
        """The jnp dtype of the parameters."""
        return _PARAM_DTYPES[self.param_dtype]

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
            if rope_type == "llama3":
                needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                missing = [k for k in needed if k not in self.rope_scaling]
                if missing:
                    raise ValueError(f"ModelConfig.rope_scaling (llama3) is missing keys {missing}; it needs {needed}.")
                if self.rope_scaling["high_freq_factor"] == self.rope_scaling["low_freq_factor"]:
                    raise ValueError("ModelConfig.rope_scaling: high_freq_factor must differ from low_freq_factor.")
            elif rope_type != "default":
                raise ValueError(
                        f"ModelConfig.rope_scaling rope_type={rope_type!r} is not supported; use None, "
                        "'default' or 'llama3'.")
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
