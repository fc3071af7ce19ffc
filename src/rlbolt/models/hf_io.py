"""Hugging Face checkpoints in and out: safetensors <-> Decoder (config mapping: `hf_config`).

Supported architectures: LlamaForCausalLM (Llama 3 / 3.1 / 3.2, llama3 rope scaling),
MistralForCausalLM (sliding window), Qwen3MoeForCausalLM (experts stacked on load, one Linear per
expert on save, as the Hub's files), Qwen2ForCausalLM (Qwen2 / 2.5: q/k/v bias), Qwen3ForCausalLM
(per-head q/k RMSNorm), Gemma2ForCausalLM and Gemma3ForCausalLM (text; sandwich norms stored as HF's
zero-centred weights, so they load and save unchanged).

HF stores `nn.Linear` weights as [out, in] with separate q/k/v and gate/up projections; rlbolt
keeps kernels as [in, out] with q|k|v and gate|up fused along the output axis (see the layout in
`rlbolt.models.decoder`). Loading concatenates then transposes; saving splits then transposes.
Tensors are read with `safetensors` (numpy framework; bfloat16, which numpy lacks, is read from
the file's byte range as `ml_dtypes.bfloat16`), and the model is built abstractly with
`nnx.eval_shape` and filled, so a large model is never initialised randomly first.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from rlbolt.models.config import ModelConfig
from rlbolt.models.decoder import Decoder
from rlbolt.models.hf_layout import flat_params, hf_tensor_layout, split_sizes
from rlbolt.utils.files import default_file_mode, replace_folder
from rlbolt.models.hf_config import CONFIG_FILE, config_from_hf, config_to_hf

__all__ = ["config_from_hf", "config_to_hf", "load_hf", "read_hf_config", "save_hf", "hf_tensor_layout"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
)
_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# ----------------------------------------------------------------------------- reading


class _SafetensorsReader:
    """Reads named tensors from one or more safetensors files, with errors naming the file."""

    def __init__(self, folder: Path):
        self.folder = folder
        index_path, single_path = folder / INDEX_FILE, folder / SINGLE_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index_path} is not a valid safetensors index (needs a \"weight_map\"): {error}") from error
            for shard in sorted(set(weight_map.values())):
                if not (folder / shard).is_file():
                    raise FileNotFoundError(f"{index_path} references shard {shard}, which is missing from {folder}.")
            self.files = sorted({folder / shard for shard in weight_map.values()})
            self.location = {name: folder / shard for name, shard in weight_map.items()}
        elif single_path.is_file():
            self.files = [single_path]
            self.location = {name: single_path for name in self._keys(single_path)}
        else:
            raise FileNotFoundError(
                f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; save the model with "
                "`save_pretrained(..., safe_serialization=True)` or rlbolt's save_hf."
            )

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safetensors.safe_open(str(path), framework="numpy") as handle:
                return list(handle.keys())
        except Exception as error:  # SafetensorError derives from Exception only
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from error

    def read(self, name: str) -> np.ndarray:
        path = self.location.get(name)
        if path is None:
            searched = ", ".join(p.name for p in self.files)
            raise ValueError(f"tensor {name!r} is missing: searched {searched} in {self.folder}.")
        try:
            with safetensors.safe_open(str(path), framework="numpy") as handle:
                present = name in handle.keys()
                if present and handle.get_slice(name).get_dtype() == "BF16":
                    return _read_bf16(path, name)
                if present:
                    return handle.get_tensor(name)
        except Exception as error:  # SafetensorError derives from Exception only
            raise ValueError(f"{path}: cannot read tensor {name!r} (truncated or corrupt?): {error}") from error
        raise ValueError(f"tensor {name!r} is missing from {path}, although {INDEX_FILE} lists it there.")


def _read_bf16(path: Path, name: str) -> np.ndarray:
    # numpy has no bfloat16; the library already validated the header, so read the byte range.
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        entry = json.loads(handle.read(header_len))[name]
        start, end = entry["data_offsets"]
        handle.seek(8 + header_len + start)
        data = handle.read(end - start)
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(entry["shape"])


def read_hf_config(folder: str | os.PathLike, *, param_dtype: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder, after checking its weight files are there.

    Reads config.json and the safetensors headers (or the shard index), not the weights: a
    cheap check that `load_hf` will find what it needs.

    Args:
        folder: a Hugging Face model folder.
        param_dtype: as in `load_hf`.

    Returns:
        The validated ModelConfig.

    Raises:
        FileNotFoundError: the folder, config.json, the weights or a shard is missing.
        ValueError: unsupported architecture or an unreadable file.
    """
    return _open_folder(Path(folder), param_dtype)[0]


def _open_folder(folder: Path, param_dtype: str | None) -> tuple[ModelConfig, _SafetensorsReader]:
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG_FILE}; is it a Hugging Face model folder?")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error
    config = config_from_hf(hf_config, config_path, param_dtype=param_dtype)
    return config, _SafetensorsReader(folder)


def load_hf(folder: str | os.PathLike, *, param_dtype: str | None = None,
            sharding: Any = None) -> tuple[Decoder, ModelConfig]:
    """Loads a Hugging Face Llama 3 / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 folder into an rlbolt Decoder.

    Args:
        folder: holds config.json and model.safetensors, or sharded
            model-0000x-of-0000y.safetensors files with model.safetensors.index.json.
        param_dtype: "float32" or "bfloat16"; None keeps the checkpoint's dtype.
        sharding: a `rlbolt.distributed.ShardingPlan`: each tensor goes from host memory straight
            to its shards (no device holds the whole model). None: the default device.

    Returns:
        (model, config).

    Raises:
        FileNotFoundError: config.json, the weights or a shard named by the index is missing.
        ValueError: unsupported architecture, a corrupt file, a tensor of the wrong shape, or a
            missing tensor (naming it and the files searched).
    """
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    config, reader = _open_folder(folder, param_dtype)

    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = flat_params(state)
    layout = hf_tensor_layout(config)
    unmapped = sorted(set(params) - set(layout))
    if unmapped:  # a decoder change the converter has not caught up with
        raise RuntimeError(f"rlbolt parameters {unmapped} have no Hugging Face mapping in hf_layout.hf_tensor_layout.")
    dtype = _NUMPY_DTYPES[config.param_dtype]
    targets = flat_params(sharding.param_shardings(state)) if sharding is not None else {}
    for path, variable in params.items():
        entry = layout[path]
        expected = variable.get_value().shape
        if entry.experts:
            per = len(entry.sources) // entry.experts
            value = np.stack([_assemble(reader, config, config_path, path, entry.sources[e * per:(e + 1) * per],
                                        entry.transpose, expected[1:]) for e in range(entry.experts)])
        else:
            value = _assemble(reader, config, config_path, path, entry.sources, entry.transpose, expected)
        value = value.astype(dtype, copy=False)
        target = targets.get(path)
        variable.set_value(sharding.place(value, target.get_value()) if target is not None else jax.numpy.asarray(value))
    return nnx.merge(graphdef, state), config


def _assemble(reader, config, config_path, path, sources, transpose, expected) -> np.ndarray:
    """One rlbolt tensor of shape `expected` from its HF sources: shapes checked, concatenated, transposed."""
    parts = [reader.read(name) for name in sources]
    sizes = split_sizes(path, config, len(parts), expected[-1] if transpose else expected[0])
    for name, part, size in zip(sources, parts, sizes):
        want = ((size, expected[0]) if transpose else (size, *expected[1:]))
        if tuple(part.shape) != want:
            raise ValueError(
                f"tensor {name!r} in {reader.location[name]} has shape {tuple(part.shape)}, but {config_path} "
                f"implies {want}; the weights and config.json do not belong together."
            )
    value = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    return value.T if transpose else value


# ----------------------------------------------------------------------------- writing


def _hf_tensors(model: Decoder, config: ModelConfig) -> dict[str, np.ndarray]:
    params = flat_params(nnx.state(model, nnx.Param))
    tensors = {}
    for path, entry in hf_tensor_layout(config).items():
        if path not in params:
            raise ValueError(f"model has no parameter {path!r}, which config {config.architecture} requires.")
        value = np.asarray(jax.device_get(params[path].get_value()))
        stacked = list(value) if entry.experts else [value]
        per = len(entry.sources) // len(stacked)
        for e, one in enumerate(stacked):
            one = one.T if entry.transpose else one
            sources = entry.sources[e * per:(e + 1) * per]
            sizes = split_sizes(path, config, len(sources), one.shape[0])
            for name, part in zip(sources, np.split(one, np.cumsum(sizes)[:-1], axis=0)):
                tensors[name] = np.ascontiguousarray(part)
    return tensors


def _shards(tensors: dict[str, np.ndarray], max_shard_bytes: int | None) -> list[dict[str, np.ndarray]]:
    if max_shard_bytes is None:
        return [tensors]
    shards, current, size = [], {}, 0
    for name, value in tensors.items():
        if current and size + value.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    return shards + [current]


def save_hf(
    model: Decoder,
    config: ModelConfig,
    folder: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
    tokenizer_folder: str | os.PathLike | None = None,
    overwrite: bool = True,
) -> Path:
    """Writes a Hugging Face folder (config.json + safetensors) that transformers loads.

    The folder is written in full under a temporary name beside the target and then renamed
    into place, so a crash never leaves a half-written folder at `folder`.

    Args:
        model: the Decoder.
        config: its config.
        folder: the output folder (replaced when it exists and `overwrite`).
        max_shard_bytes: split the weights into model-0000x-of-0000y.safetensors shards of at most
            this many bytes (a single larger tensor gets its own shard) plus an index; None writes
            one model.safetensors.
        tokenizer_folder: copy the tokenizer files found there (tokenizer.json, tokenizer_config.json, ...);
            a `.gguf` file's tokenizer goes through `rlbolt.data.gguf_tokenizer.hf_tokenizer_folder` first.
        overwrite: replace an existing folder; False raises FileExistsError instead.

    Returns:
        The folder path.
    """
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} exists; pass overwrite=True or choose another folder.")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be a positive number of bytes (or None).")
    hf_config = config_to_hf(config)
    tensors = _hf_tensors(model, config)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        shards = _shards(tensors, max_shard_bytes)
        metadata = {"format": "pt"}  # transformers refuses safetensors without a known format tag
        if len(shards) == 1 and max_shard_bytes is None:
            safetensors.numpy.save_file(shards[0], str(staging / SINGLE_FILE), metadata=metadata)
        else:
            weight_map = {}
            for number, shard in enumerate(shards, start=1):
                name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                safetensors.numpy.save_file(shard, str(staging / name), metadata=metadata)
                weight_map.update(dict.fromkeys(shard, name))
            index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for path in staging.glob("*.safetensors"):  # safetensors creates its files 0600
            os.chmod(path, default_file_mode())
        if tokenizer_folder is not None:
            source = Path(tokenizer_folder)
            found = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
            if not any(p.name == "tokenizer.json" for p in found):
                raise FileNotFoundError(f"tokenizer_folder {source} has no tokenizer.json to copy.")
            for path in found:
                shutil.copy2(path, staging / path.name)
        replace_folder(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def tokenizer_source(*candidates: str | os.PathLike | None) -> str | None:
    """The first candidate an export can take its tokenizer from: a folder with a tokenizer.json,
    or a `.gguf` file (`rlbolt.data.gguf_tokenizer.hf_tokenizer_folder` writes its tokenizer as Hugging
    Face files); None if none."""
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate)
        if (path.is_dir() and (path / "tokenizer.json").is_file()) or (path.is_file() and path.suffix.lower() == ".gguf"):
            return str(path)
    return None
