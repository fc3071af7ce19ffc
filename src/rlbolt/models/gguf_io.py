"""GGUF files in: llama.cpp's single-file checkpoints -> an rlbolt Decoder (+ their tokenizer).

A `.gguf` file holds the model's hyper-parameters and tokenizer as key/value metadata and its
weights as named tensors, many of them quantised in blocks (Q8_0, Q4_0, Q4_1, the K-quants...).
`load_gguf_model` reads it with llama.cpp's own Python reader (the `gguf` package, an optional
extra: `pip install 'rlbolt[gguf]'`), de-quantises every tensor with that package's NumPy
decoders to float32, and fills the Decoder the same way `hf_io.load_hf` does, through the same
Hugging Face layout (`hf_layout.hf_tensor_layout`): the weights become the model you would get by
de-quantising the file into a Hugging Face folder and loading that.

Three things differ from a Hugging Face folder and are undone here:

- names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight` and so on (`_GGUF_NAMES`);
- llama's q/k rows: llama.cpp rotates interleaved pairs, so its converter reorders the rows of
  each q and k head (HF's two halves -> pairs) for the `llama` architecture only (qwen2/qwen3
  rotate halves, as HF does). `_unpermute_rows` restores the halves;
- tied embeddings: a file without `output.weight` reuses `token_embd.weight` for the logits.

Llama 3.1's rope scaling is stored as a `rope_freqs.weight` tensor of per-frequency factors
rather than as metadata; it is matched against the llama3 rule (factor = its largest entry,
low/high frequency factors 1 and 4, 8,192 original positions) and refused when it does not fit.
Architectures other than llama, qwen2 and qwen3 are refused in one line naming the file's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rlbolt.models.config import ModelConfig
from rlbolt.models.decoder import Decoder
from rlbolt.models.hf_layout import flat_params, hf_tensor_layout, split_sizes
from rlbolt.models.rope import rope_inv_freq

from rlbolt.data.tokenizers import HFTokenizer
from rlbolt.data.gguf_file import gguf_field, gguf_module as _gguf_module, is_gguf_path, open_gguf  # noqa: F401

__all__ = ["GGUF_ARCHITECTURES", "load_gguf", "load_gguf_model", "read_gguf_config", "is_gguf_path",
           "open_gguf", "gguf_field"]

# general.architecture -> the rlbolt (Hugging Face) architecture it loads as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Llama 3.1's rope_scaling besides `factor`, as every Llama 3.x release sets it.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# GGUF tensor name (per layer, after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
_ROPE_FREQS = "rope_freqs.weight"


def _architecture(reader, path: Path) -> str:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; rlbolt loads GGUF files of "
                         f"{sorted(GGUF_ARCHITECTURES)}")
    return arch


def _rope_scaling(reader, arch: str, head_dim: int, theta: float, path: Path) -> dict | None:
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling_type!r} is not supported; rlbolt's decoder has "
                         "plain RoPE and Llama 3.1's scaling (a rope_freqs tensor)")
    tensor = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = np.asarray(_dequantize(tensor), np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"{path}: {_ROPE_FREQS} has {factors.size} entries, head_dim {head_dim} needs {head_dim // 2}")
    if np.all(factors == 1.0):
        return None
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE}
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    # llama.cpp divides each frequency by its factor: the factors are plain / scaled frequencies.
    implied = rope_inv_freq(head_dim, theta, None).astype(np.float64) / rope_inv_freq(head_dim, theta, scaling)
    if not np.allclose(factors, implied, rtol=1e-4, atol=0.0):
        raise ValueError(f"{path}: {_ROPE_FREQS} does not follow Llama 3.1's rope scaling (factor "
                         f"{scaling['factor']:g}, low/high frequency factors 1/4), the only scaling rlbolt supports")
    return scaling


def _config(reader, path: Path, param_dtype: str | None) -> ModelConfig:
    arch = _architecture(reader, path)

    def number(key: str, default: Any = None, kind=int):
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: metadata {arch}.{key} is missing; the file does not describe a {arch} model")
        return kind(value)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor token_embd.weight is missing; the file holds no {arch} model weights")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are [ne0 = H, ne1 = V]
    hidden = number("embedding_length")
    heads = number("attention.head_count")
    head_dim = number("attention.key_length", hidden // heads)
    rope_dims = number("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dims} rotates part of each head (head_dim "
                         f"{head_dim}); rlbolt's decoder rotates whole heads")
    theta = number("rope.freq_base", 10000.0, float)
    if param_dtype is None:  # a bfloat16 file stays bfloat16; quantised and float16 files load as float32
        param_dtype = "bfloat16" if tensors["token_embd.weight"].tensor_type.name == "BF16" else "float32"
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=number("block_count"),
        num_heads=heads,
        num_kv_heads=number("attention.head_count_kv", heads),
        head_dim=head_dim,
        intermediate_size=number("feed_forward_length"),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta, path),
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-6, float),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=number("context_length", 2048),
        param_dtype=param_dtype,
        architecture=GGUF_ARCHITECTURES[arch],
    )
    try:
        return config.validate()
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def read_gguf_config(path: str | os.PathLike, *, param_dtype: str | None = None) -> ModelConfig:
    """The ModelConfig a GGUF file describes (metadata and tensor headers only; no weights read).

    Args:
        path: the `.gguf` file.
        param_dtype: "float32" or "bfloat16"; None: bfloat16 for a BF16 file, else float32.

    Returns:
        The validated ModelConfig.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an unsupported architecture or feature, or an unreadable file.
    """
    path = Path(path)
    return _config(open_gguf(path), path, param_dtype)


def _gguf_to_hf_names(num_layers: int) -> dict[str, str]:
    names = dict(_GGUF_GLOBAL_NAMES)
    for i in range(num_layers):
        names.update({f"blk.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _GGUF_LAYER_NAMES.items()})
    return names


def _dequantize(tensor) -> np.ndarray:
    """A reader tensor as float32 in Hugging Face's row-major shape ([out, in] for a matrix)."""
    gguf = _gguf_module()
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (the row length) first
    try:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf package "
                         "cannot de-quantise; re-quantise the file (e.g. Q8_0, Q4_K or F16)") from None
    return np.asarray(values, np.float32).reshape(shape)


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order: in each head, rows (0, D/2, 1, D/2+1, ...) -> (0, 1, ..., D-1).

    Args:
        weight: [num_heads * D, ...] as stored in the GGUF file.
        num_heads: query heads for q, key/value heads for k.

    Returns:
        The same rows in Hugging Face's order (each head's two rotary halves contiguous).
    """
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _hf_sources(reader, config: ModelConfig, path: Path) -> dict[str, Any]:
    """{Hugging Face tensor name: the file's tensor}, refusing tensors rlbolt's decoder has no place for."""
    names = _gguf_to_hf_names(config.num_layers)
    present = {t.name: t for t in reader.tensors}
    unknown = sorted(set(present) - set(names) - {_ROPE_FREQS})
    if unknown:
        shown = ", ".join(unknown[:4]) + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else "")
        raise ValueError(f"{path}: tensors {shown} have no place in rlbolt's {config.architecture} decoder (an "
                         "o_proj/MLP bias or another feature it lacks)")
    return {names[name]: tensor for name, tensor in present.items() if name != _ROPE_FREQS}


def _hf_rows(value: np.ndarray, tensor, config: ModelConfig) -> np.ndarray:
    """A de-quantised tensor in Hugging Face's row order (llama's q/k rows restored)."""
    if config.architecture == "LlamaForCausalLM" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        value = _unpermute_rows(value, config.num_heads if tensor.name.endswith("attn_q.weight") else config.num_kv_heads)
    return value


def load_gguf_model(path: str | os.PathLike, *, param_dtype: str | None = None,
                    sharding: Any = None) -> tuple[Decoder, ModelConfig]:
    """Loads the weights of a llama / qwen2 / qwen3 GGUF file into an rlbolt Decoder.

    Every tensor is de-quantised to float32 (any type the `gguf` package decodes: F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, ...) and then cast to `param_dtype`.

    Args:
        path: the `.gguf` file.
        param_dtype: "float32" or "bfloat16"; None: bfloat16 for a BF16 file, else float32.
        sharding: a `rlbolt.distributed.ShardingPlan` (each tensor goes from host memory to its
            shards), or None for the default device.

    Returns:
        (model, config).

    Raises:
        ImportError: the gguf package is not installed.
        FileNotFoundError: no such file.
        ValueError: unsupported architecture or feature, a missing tensor, or a corrupt file.
    """
    path = Path(path)
    reader = open_gguf(path)
    config = _config(reader, path, param_dtype)
    sources = _hf_sources(reader, config, path)  # read one parameter at a time: float32 copies stay small
    reverse = {hf: gguf_name for gguf_name, hf in _gguf_to_hf_names(config.num_layers).items()}

    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = flat_params(state)
    layout = hf_tensor_layout(config)
    dtype = _NUMPY_DTYPES[config.param_dtype]
    targets = flat_params(sharding.param_shardings(state)) if sharding is not None else {}
    for name, variable in params.items():
        entry = layout[name]
        expected = variable.get_value().shape
        missing = [reverse[source] for source in entry.sources if source not in sources]
        if missing:
            raise ValueError(f"{path}: tensor {missing[0]} is missing; a {config.architecture} of this config needs it")
        parts = [_dequantize(sources[source]) for source in entry.sources]
        sizes = split_sizes(name, config, len(parts), expected[-1] if entry.transpose else expected[0])
        for source, part, size in zip(entry.sources, parts, sizes):
            want = (size, expected[0]) if entry.transpose else (size, *expected[1:])
            if part.shape != want:
                raise ValueError(f"{path}: tensor {reverse[source]} has shape {part.shape[::-1]} (GGUF order), the "
                                 f"file's metadata implies {want[::-1]}; the file is inconsistent")
        parts = [_hf_rows(part, sources[source], config) for source, part in zip(entry.sources, parts)]
        value = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        value = (value.T if entry.transpose else value).astype(dtype)
        target = targets.get(name)
        variable.set_value(sharding.place(value, target.get_value()) if target is not None else jax.numpy.asarray(value))
    return nnx.merge(graphdef, state), config


def load_gguf(path: str | os.PathLike, *, param_dtype: str | None = None,
              sharding: Any = None) -> tuple[Decoder, HFTokenizer]:
    """Loads a GGUF file's model and its tokenizer: the `load_hf` of a `.gguf` file.

    Args:
        path: the `.gguf` file.
        param_dtype: see `load_gguf_model`.
        sharding: see `load_gguf_model`.

    Returns:
        (model, tokenizer): a Decoder (its config at `model.config`) and an `HFTokenizer` built
            from the file's tokenizer metadata and chat template (`rlbolt.data.gguf_tokenizer`).
    """
    from rlbolt.data.gguf_tokenizer import gguf_tokenizer

    model, _ = load_gguf_model(path, param_dtype=param_dtype, sharding=sharding)
    return model, gguf_tokenizer(path)
