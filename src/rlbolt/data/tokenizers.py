"""Tokenizers: the `Tokenizer` protocol, a Hugging Face folder loader, and two tiny built-ins.

`HFTokenizer` reads a model folder the way `transformers.AutoTokenizer` does, without importing
transformers: the fast tokenizer comes from `tokenizer.json` (the `tokenizers` library), special
tokens and the chat template from `tokenizer_config.json` (or `special_tokens_map.json`), and a
`chat_template.jinja` file, when present, overrides the config's template. Chat templates are
rendered by `rlbolt.data.chat_template` exactly as `AutoTokenizer.apply_chat_template` renders them.

`CharTokenizer` and `IntTokenizer` serve synthetic tasks and the benchmark workload
(pad id 0, eos id 1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlbolt.data.chat_template import Message, render_chat_template

__all__ = ["Tokenizer", "HFTokenizer", "CharTokenizer", "IntTokenizer", "render_chat_template"]

# Names transformers passes into every chat template (its `special_tokens_map`).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@runtime_checkable
class Tokenizer(Protocol):
    """What rlbolt needs from a tokenizer.

    Attributes:
        pad_id: id used to pad prompts and completions.
        eos_id: id that ends a completion.
        bos_id: id that starts a sequence, or None when the vocabulary has none.
        vocab_size: number of ids, including added/special tokens; every id is < vocab_size.
    """

    pad_id: int
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Text -> token ids."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text."""
        ...

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Chat messages ([{"role": ..., "content": ...}, ...]) -> the prompt string."""
        ...


def _token_string(value: Any) -> str | None:
    # Special tokens appear as plain strings or as serialized AddedToken dicts ({"content": ...}).
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any, source: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{source}: chat_template lists templates {sorted(map(str, named))} but none is 'default'.")
    raise ValueError(f"{source}: chat_template must be a string or a list of named templates, got {type(value).__name__}.")


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); re-save it or re-download the tokenizer.") from error


class HFTokenizer:
    """A Hugging Face fast tokenizer with its special tokens and chat template.

    Build it with `HFTokenizer.from_folder(path)`. `encode` adds no special tokens by default:
    the usual input is a rendered chat template, which already holds them (transformers'
    `apply_chat_template(tokenize=True)` encodes the same way). Pass `add_special_tokens=True`
    for the tokenizer's post-processor (e.g. a leading BOS), like `AutoTokenizer.encode`.
    """

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        name: str = "<memory>",
    ):
        """Wraps a `tokenizers.Tokenizer`.

        Args:
            backend: a `tokenizers.Tokenizer`.
            special_tokens: token strings by name (`bos_token`, `eos_token`, `pad_token`, ...).
            chat_template: Jinja chat template source, or None.
            name: where it came from, used in error messages.
        """
        self._backend = backend
        self.special_tokens = {key: value for key, value in special_tokens.items() if value is not None}
        self.chat_template = chat_template
        self.name = name
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._id_of("bos_token")
        eos_id = self._id_of("eos_token")
        if eos_id is None:
            raise ValueError(
                f"{name}: no eos_token is set (or it is not in the vocabulary); add \"eos_token\" to "
                "tokenizer_config.json so completions can stop."
            )
        self.eos_id = eos_id
        pad_id = self._id_of("pad_token")
        # Many base models ship without a pad token; padding is always masked, so EOS is a safe stand-in.
        self.pad_id = eos_id if pad_id is None else pad_id

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """Loads `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`) from a folder.

        Args:
            folder: a Hugging Face model or tokenizer folder.

        Returns:
            The tokenizer.

        Raises:
            FileNotFoundError: the folder or its `tokenizer.json` is missing.
            ValueError: a config file is unreadable or lacks an EOS token.
        """
        import tokenizers  # imported here so the built-in tokenizers work without it

        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"Tokenizer folder {folder} does not exist.")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"Tokenizer folder {folder} has no tokenizer.json (found: {_listing(folder)}); rlbolt needs a fast tokenizer: "
                "save one with transformers' `tokenizer.save_pretrained(folder)`."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust library raises a bare Exception on bad files
            raise ValueError(f"{tokenizer_file} could not be parsed by the tokenizers library: {error}") from error

        config: dict = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            config = _read_json(config_file)
        special_tokens = {name: _token_string(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        legacy_map = folder / "special_tokens_map.json"
        if legacy_map.is_file():
            for name, value in _read_json(legacy_map).items():
                if name in _SPECIAL_TOKEN_NAMES and special_tokens.get(name) is None:
                    special_tokens[name] = _token_string(value)

        chat_template = _pick_template(config.get("chat_template"), config_file)
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():  # transformers gives the standalone file priority
            chat_template = template_file.read_text(encoding="utf-8")
        return cls(backend, special_tokens=special_tokens, chat_template=chat_template, name=str(folder))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Encodes text.

        Args:
            text: the string.
            add_special_tokens: apply the tokenizer's post-processor (e.g. prepend BOS).

        Returns:
            Token ids.
        """
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes ids (list or 1-D array) to text, dropping special tokens unless asked not to."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Renders messages with the folder's chat template (see `render_chat_template`).

        Args:
            messages: `[{"role": "system"|"user"|"assistant", "content": str}, ...]`.
            add_generation_prompt: end with the assistant header so the model answers.
            **template_kwargs: extra template variables, e.g. `enable_thinking=False` for Qwen3.

        Returns:
            The prompt string.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template: tokenizer_config.json has no \"chat_template\" and there is "
                "no chat_template.jinja; use a chat/instruct model's tokenizer or encode raw prompts instead."
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )


def _listing(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _plain_chat(messages: Sequence[Message], add_generation_prompt: bool) -> str:
    # The built-ins have no roles in their vocabulary: a conversation is its contents, one per line.
    text = "\n".join(str(message["content"]) for message in messages)
    return text + "\n" if add_generation_prompt else text


class CharTokenizer:
    """One id per character: pad 0, eos 1, bos 2, then the alphabet in order (ids 3..).

    Args:
        alphabet: the characters, each once, e.g. `"0123456789+= "`.
    """

    pad_id = 0
    eos_id = 1
    bos_id = 2
    _num_special = 3

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise ValueError(f"CharTokenizer alphabet repeats {repeated}; list each character once.")
        self.alphabet = alphabet
        self._ids = {char: index + self._num_special for index, char in enumerate(alphabet)}
        self.vocab_size = len(alphabet) + self._num_special

    def encode(self, text: str) -> list[int]:
        """Characters -> ids; a character outside the alphabet is an error naming it."""
        try:
            return [self._ids[char] for char in text]
        except KeyError as error:
            raise ValueError(
                f"CharTokenizer cannot encode {error.args[0]!r} (in {text!r}); add it to the alphabet "
                f"{self.alphabet!r}."
            ) from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> characters; specials are dropped, or shown as <pad>/<eos>/<bos> when kept."""
        names = ("<pad>", "<eos>", "<bos>")
        out = []
        for token in (int(i) for i in ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"CharTokenizer id {token} is outside [0, {self.vocab_size}).")
            if token < self._num_special:
                if not skip_special_tokens:
                    out.append(names[token])
            else:
                out.append(self.alphabet[token - self._num_special])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Joins message contents with newlines (a trailing newline asks for the answer)."""
        return _plain_chat(messages, add_generation_prompt)


class IntTokenizer:
    """Text is whitespace-separated integers and the ids are those integers: pad 0, eos 1, no bos.

    Used by the benchmark workload, whose prompts are already ids in [2, vocab_size).

    Args:
        vocab_size: ids must lie in [0, vocab_size).
    """

    pad_id = 0
    eos_id = 1
    bos_id = None

    def __init__(self, vocab_size: int):
        if vocab_size < 3:
            raise ValueError(f"IntTokenizer vocab_size={vocab_size} must be >= 3 (pad 0, eos 1, and one token).")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        """"5 17 3" -> [5, 17, 3]; non-integers and ids outside the vocabulary are errors."""
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise ValueError(f"IntTokenizer cannot encode {word!r}: text must be integers separated by spaces.") from None
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"IntTokenizer id {token} is outside [0, {self.vocab_size}).")
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> space-separated integers, dropping pad/eos unless asked not to."""
        special = (self.pad_id, self.eos_id)
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) in special))

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Joins message contents with spaces (ids carry no roles)."""
        return " ".join(str(message["content"]) for message in messages)
