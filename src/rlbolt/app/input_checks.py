"""What `rlbolt.app.build.assemble_run` checks before a run folder exists, each error naming the
config field a user set (and the file and line for data): the model and tokenizer folders, the
model's vocabulary against the tokenizer, a reward the process executor can pickle, and every
prompt against the tokenizer that will encode it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlbolt.config import ConfigError, RunConfig
from rlbolt.data import DataFileError
from rlbolt.models.gguf_io import is_gguf_path, read_gguf_config


def check_builtin_row(check: Callable, row: Mapping[str, Any], index: int) -> None:
    """`check(row)` on a built-in row; a failure becomes a DataFileError naming the row."""
    try:
        check(row)
    except (ValueError, TypeError, KeyError) as error:
        raise DataFileError(f"built-in row {index}: {error}") from None


def tokenizer(cfg: RunConfig) -> Any:
    """The tokenizer of `model.tokenizer` / `model.path`, or the built-in one; errors name the field."""
    from rlbolt.modules import lm_ops
    from rlbolt.modules.prompts import builtin_tokenizer

    field, folder = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    if not folder:
        return builtin_tokenizer()
    if not (Path(folder).is_dir() or (is_gguf_path(folder) and Path(folder).is_file())):
        fix = ("a local Hugging Face tokenizer folder (or a .gguf file)" if field == "model.tokenizer" else
               "a local Hugging Face model folder or .gguf file, or model.path=null for the tiny random model")
        raise ConfigError(f"{field}={folder} does not exist; give {fix}")
    try:
        return lm_ops.load_tokenizer(folder)
    except (OSError, ValueError) as error:
        also = " (the tokenizer is read from model.path unless model.tokenizer is set)" if field == "model.path" else ""
        raise ConfigError(f"{field}={folder}: {error}{also}") from None


def model_config(cfg: RunConfig) -> Any:
    """The ModelConfig `model.path` (config.json, weight headers) or `model.tiny` describes, or None
    for the tiny model (whose vocabulary is the tokenizer's); errors name the field."""
    from rlbolt.models import ModelConfig, read_hf_config, tiny_config

    if cfg.model.path and is_gguf_path(cfg.model.path):
        if not Path(cfg.model.path).is_file():
            raise ConfigError(f"model.path={cfg.model.path} does not exist; give a local .gguf file or model folder")
        try:
            return read_gguf_config(cfg.model.path, param_dtype=cfg.model.param_dtype)
        except (OSError, ValueError, ImportError) as error:
            raise ConfigError(f"model.path={cfg.model.path}: {error}") from None
    if cfg.model.path:
        if not Path(cfg.model.path).is_dir():
            raise ConfigError(f"model.path={cfg.model.path} does not exist; give a local Hugging Face model folder "
                              "(config.json + *.safetensors), or model.path=null for the tiny random model")
        try:
            return read_hf_config(cfg.model.path, param_dtype=cfg.model.param_dtype)
        except (OSError, ValueError) as error:
            raise ConfigError(f"model.path={cfg.model.path}: {error}") from None
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = [k for k in cfg.model.tiny if k not in known]
    if unknown:
        raise ConfigError(f"model.tiny has unknown key(s) {unknown}; ModelConfig fields: {known}")
    try:
        tiny_config(**{"param_dtype": cfg.model.param_dtype, **cfg.model.tiny})
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.tiny={dict(cfg.model.tiny)}: {error}") from None
    return tiny_config(**cfg.model.tiny) if "vocab_size" in cfg.model.tiny else None


def check_vocab(cfg: RunConfig, model_config: Any, vocab_size: int) -> None:
    """The model's vocabulary covers every id the tokenizer can produce."""
    if vocab_size > model_config.vocab_size:
        field = f"model.path={cfg.model.path}" if cfg.model.path else "model.tiny.vocab_size"
        raise ConfigError(f"{field}: the model's vocab_size is {model_config.vocab_size} but the tokenizer has "
                          f"{vocab_size} ids; use the tokenizer that belongs to the model")


def check_picklable(reward: Any) -> None:
    """A reward that `reward.executor=process` can send to its worker processes."""
    import pickle

    try:
        pickle.dumps(reward)
    except Exception as error:  # noqa: BLE001 - pickling raises many kinds
        raise ConfigError(f"reward.executor=process sends the reward to worker processes, but {reward!r} cannot be "
                          f"pickled ({type(error).__name__}); use a module-level function, or reward.executor=thread") from None


def check_prompt(encoder: Any, row: Mapping[str, Any], builtin: bool) -> None:
    """The row's prompt is text the tokenizer encodes (the built-in one knows printable ASCII only)."""
    try:
        encoder.encode(row)
    except ValueError:
        bad = sorted({ch for ch in encoder.text(row) if ch not in encoder.tokenizer.alphabet}) if builtin else []
        if not bad:
            raise
        raise ValueError(f"the prompt has {''.join(bad)!r}, which the built-in character tokenizer (printable ASCII) "
                         "cannot encode; use ASCII prompts, or a real tokenizer (model.tokenizer or model.path)") from None
