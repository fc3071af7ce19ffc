"""The tokenizer of a GGUF file, rebuilt as a `tokenizers` byte-level BPE inside an `HFTokenizer`.

A GGUF file carries its tokenizer as metadata: `tokenizer.ggml.tokens` (every token, its index
is its id, spelled in GPT-2's byte-to-unicode alphabet for byte-level vocabularies),
`tokenizer.ggml.merges` ("a b" pairs, best first), `tokenizer.ggml.token_type` (1 normal,
3 control, 4 user-defined, ...), the bos/eos/pad ids, `tokenizer.ggml.add_bos_token` and the
Jinja `tokenizer.chat_template`. What it does not carry is the pre-tokenizer (how text is split
before merging): only its name, `tokenizer.ggml.pre`. `_PRE_TOKENIZERS` maps the names of the
Llama 3, Qwen2/2.5/3 and SmolLM/StarCoder families to the splits their Hugging Face tokenizers
use; other names are refused (point `model.tokenizer` at a Hugging Face tokenizer folder).

Control tokens become special added tokens (so `<|im_start|>` in a rendered chat prompt is one
id, and `decode` drops it) and user-defined ones (`<think>`) plain added tokens, as in the
Hugging Face tokenizer the file was converted from. `save_gguf_tokenizer` writes the rebuilt
tokenizer as `tokenizer.json` + `tokenizer_config.json`, which `HFTokenizer.from_folder` and
transformers' `AutoTokenizer` load: what an export of a run trained from a GGUF file needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlbolt.data.tokenizers import HFTokenizer

__all__ = ["gguf_tokenizer", "save_gguf_tokenizer", "GGUF_PRE_TOKENIZERS"]

_CONTROL, _USER_DEFINED = 3, 4
# Meta's Llama 3 (tiktoken) split: contractions, letters with one leading non-letter, 1-3 digits.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split: Llama 3's with single digits.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split regex or a named built-in split, ignore_merges).
# "gpt2": GPT-2's own split (ByteLevel's regex); "digits+gpt2": single digits first (SmolLM, StarCoder).
# ignore_merges: a word that is itself a token is taken whole (Llama 3's tokenizer.json sets it).
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    **{name: (_LLAMA3_SPLIT, True) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")},
    **{name: (_QWEN2_SPLIT, False) for name in ("qwen2", "deepseek-r1-qwen")},
    **{name: ("digits+gpt2", False) for name in ("smollm", "starcoder", "refact")},
    "gpt-2": ("gpt2", False),
    "gpt2": ("gpt2", False),
}


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _metadata(path: Path) -> dict[str, Any]:
    from rlbolt.data.gguf_file import gguf_field, open_gguf

    reader = open_gguf(path)
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token",
            "tokenizer.chat_template")
    return {key: gguf_field(reader, key) for key in keys}


def _backend(meta: dict[str, Any], path: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta["tokenizer.ggml.model"]
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={model!r} is not supported; rlbolt rebuilds byte-level BPE "
                         "('gpt2') tokenizers only: set model.tokenizer to the model's Hugging Face tokenizer folder")
    pre = meta["tokenizer.ggml.pre"] or "gpt2"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer rlbolt knows "
                         f"({sorted(GGUF_PRE_TOKENIZERS)}): set model.tokenizer to the model's Hugging Face tokenizer folder")
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    if not tokens or merges is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing; the file has no BPE tokenizer")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens lists a token twice ({len(tokens) - len(vocab)} repeats); "
                         "ids would not round-trip")
    split, ignore_merges = GGUF_PRE_TOKENIZERS[pre]
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = _pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"] or []
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == _USER_DEFINED])
    bos = meta["tokenizer.ggml.bos_token_id"]
    if meta["tokenizer.ggml.add_bos_token"] and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _special_tokens(meta: dict[str, Any], path: Path) -> dict[str, str]:
    tokens = meta["tokenizer.ggml.tokens"]
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                      ("unk_token", "unknown_token_id")):
        index = meta[f"tokenizer.ggml.{key}"]
        if index is None:
            continue
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{key}={index} is outside the vocabulary of {len(tokens)} tokens")
        out[name] = tokens[int(index)]
    if "eos_token" not in out:
        raise ValueError(f"{path}: tokenizer.ggml.eos_token_id is missing, so completions could not stop; "
                         "set model.tokenizer to the model's Hugging Face tokenizer folder")
    return out


def gguf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer (with special tokens and chat template) a GGUF file describes.

    Args:
        path: the `.gguf` file.

    Returns:
        An `HFTokenizer`: `encode` adds no special tokens unless asked (then BOS when the file's
        `add_bos_token` says so), `apply_chat_template` renders `tokenizer.chat_template`.

    Raises:
        ImportError: the gguf package is not installed.
        FileNotFoundError: no such file.
        ValueError: a tokenizer kind or pre-tokenizer rlbolt cannot rebuild, or no EOS token.
    """
    path = Path(path)
    meta = _metadata(path)
    backend = _backend(meta, path)
    return HFTokenizer(backend, special_tokens=_special_tokens(meta, path),
                       chat_template=meta["tokenizer.chat_template"], name=str(path))


def save_gguf_tokenizer(path: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Writes a GGUF file's tokenizer as a Hugging Face tokenizer folder.

    Args:
        path: the `.gguf` file.
        folder: where to write `tokenizer.json` and `tokenizer_config.json` (created if needed;
            files of those names are replaced).

    Returns:
        The folder, loadable by `HFTokenizer.from_folder` and `transformers.AutoTokenizer`.
    """
    path, folder = Path(path), Path(folder)
    meta = _metadata(path)
    backend = _backend(meta, path)
    special = _special_tokens(meta, path)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"]), "clean_up_tokenization_spaces": False}
    if meta["tokenizer.chat_template"] is not None:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return folder


@contextlib.contextmanager
def hf_tokenizer_folder(source: str | os.PathLike | None) -> Iterator[str | None]:
    """A folder of Hugging Face tokenizer files for `source`: the folder itself, or for a `.gguf`
    file a temporary folder its tokenizer is written into (`save_gguf_tokenizer`), removed after."""
    if source is None or not str(source).lower().endswith(".gguf"):
        yield None if source is None else str(source)
        return
    with tempfile.TemporaryDirectory(prefix="rlbolt-gguf-tokenizer-") as folder:
        yield str(save_gguf_tokenizer(source, folder))
