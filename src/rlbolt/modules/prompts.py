"""Prompt rows -> token ids: chat template, truncation, and left padding to one fixed width.

Every on_rollout call pads prompts to the same width (`data.max_prompt_tokens`), so the chunks
the producer concatenates (rollout micro batches, DAPO refill rounds) share one `[N, P]` shape
and the jitted logps/training functions compile once.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import numpy as np

from rlbolt.data.tokenizers import CharTokenizer, Tokenizer

# Printable ASCII plus newline: enough for the built-in rows and most English prompts.
BUILTIN_ALPHABET = "".join(ch for ch in string.printable if ch not in "\t\r\x0b\x0c")


def builtin_tokenizer() -> CharTokenizer:
    """The character tokenizer used with the tiny random model (pad 0, eos 1, bos 2)."""
    return CharTokenizer(BUILTIN_ALPHABET)


class PromptEncoder:
    """Turns prompt rows into token id lists (cached per distinct text).

    Args:
      tokenizer: any `rlbolt.data.Tokenizer`.
      prompt_field: the row field holding the prompt text (or a list of chat messages).
      max_prompt_tokens: prompts keep their last `max_prompt_tokens` ids; also the padded width.
      system_prompt: a system message put first when a chat template is used.
      use_chat_template: render a chat template when the tokenizer has one (`chat_template`
        attribute not None); the built-in tokenizers have none, so their prompts are the raw text.
      template_kwargs: extra chat-template variables (`data.chat_template_kwargs`, e.g.
        `{"enable_thinking": False}`).
    """

    def __init__(self, tokenizer: Tokenizer, *, prompt_field: str = "question", max_prompt_tokens: int = 256,
                 system_prompt: str | None = None, use_chat_template: bool = True,
                 template_kwargs: Mapping[str, Any] | None = None):
        if max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens={max_prompt_tokens} must be >= 1")
        self.tokenizer, self.prompt_field, self.width = tokenizer, prompt_field, int(max_prompt_tokens)
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.chat = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self._cache: dict[str, list[int]] = {}

    def text(self, row: Mapping[str, Any]) -> str:
        """The prompt string of one row (chat-formatted when a template is used)."""
        if self.prompt_field not in row:
            raise KeyError(
                f"prompt row has no field {self.prompt_field!r} (fields: {sorted(row)}); set data.prompt_field"
            )
        messages = _messages(row[self.prompt_field], self.prompt_field)
        if not self.chat:
            return "\n".join(str(m["content"]) for m in messages)
        if self.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **self.template_kwargs)
        except jinja2.TemplateError as error:  # e.g. a template that refuses a system message
            raise ValueError(f"the tokenizer's chat template refused the prompt ({error}); set "
                             "data.use_chat_template=false, or data.system_prompt=null if it rejects system messages") from None

    def encode(self, row: Mapping[str, Any]) -> list[int]:
        """Token ids of one row's prompt, truncated on the left to `max_prompt_tokens`.

        Raises:
          KeyError: the row has no prompt field.
          TypeError: the prompt is not text (nor a list of chat messages).
          ValueError: the tokenizer cannot encode it, or it encodes to no tokens.
        """
        text = self.text(row)
        ids = self._cache.get(text)
        if ids is None:
            ids = list(self.tokenizer.encode(text))[-self.width:]
            if not ids:
                raise ValueError(f"the prompt {text[:60]!r} encodes to no tokens; give every row a non-empty "
                                 f"{self.prompt_field!r}")
            if len(self._cache) < 100_000:
                self._cache[text] = ids
        return ids

    def encode_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [self.encode(row) for row in rows]

    def pad_left(self, ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Left-pads id lists to the fixed width.

        Returns:
          (prompt_ids [N, P] int32, prompt_mask [N, P] bool) with P = max_prompt_tokens.
        """
        out = np.full((len(ids), self.width), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(ids), self.width), bool)
        for i, row in enumerate(ids):
            if len(row):
                out[i, -len(row):] = row
                mask[i, -len(row):] = True
        return out, mask


def _messages(value: Any, field: str) -> list[Mapping[str, Any]]:
    """A prompt value as chat messages: a string is one user message; a message list is kept."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(m, Mapping) and "role" in m and isinstance(m.get("content"), str) for m in value)):
        return list(value)
    shown = "null" if value is None else f"{type(value).__name__} " + (
        repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "...")
    raise TypeError(f"the prompt field {field!r} holds {shown}; a prompt is a string or a list of chat messages "
                    "[{'role': 'user', 'content': '...'}]")


def rows_of(batch: Mapping[str, Any], fields: Sequence[str]) -> list[dict[str, Any]]:
    """The per-sample dicts of the given columns (the prompt rows' own fields, for rewards)."""
    n = len(next(iter(batch.values()))) if batch else 0
    return [{f: _item(batch[f][i]) for f in fields} for i in range(n)]


def _item(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
