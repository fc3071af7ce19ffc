"""Tool calls parsed from a model turn's text, behind a one-method interface a user can replace.

A parser is anything with `parse(text) -> ParsedTurn`: the turn's text outside the calls
(`content`), the well-formed calls, and one message per malformed call (which the environment
shows the model). The formats shipped:

- `HermesToolParser`: Qwen2 / Qwen2.5 / Qwen3 (and Hermes-style) models:
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number per turn.
- `Llama3JsonToolParser`: Llama 3.1 / 3.2 / 3.3 JSON calls: the turn is
  `{"name": "f", "parameters": {...}}` (optionally after `<|python_tag|>`; several calls separated
  by `;`). Text that does not start with `{` is an answer.
- `CompactToolParser`: one character introduces a call and the rest of the turn is its one
  argument (`?k` -> `lookup(key="k")`), for tiny models on a character tokenizer.

Reasoning models think before they answer (`<think>...</think>answer`). Every shipped parser
first splits the reasoning off (`split_reasoning`, as a serving stack's reasoning parser does
before its tool parser): a call written while thinking is not a call, and `ParsedTurn.content`
is the answer alone (`ParsedTurn.reasoning` holds the thinking).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

__all__ = ["ToolCall", "ParsedTurn", "ToolCallParser", "HermesToolParser", "Llama3JsonToolParser",
           "CompactToolParser", "THINK_TAGS", "split_reasoning"]

THINK_TAGS = ("<think>", "</think>")  # Qwen3, DeepSeek-R1, QwQ and most open reasoning models


def split_reasoning(text: str, tags: tuple[str, str] | None = THINK_TAGS) -> tuple[str, str]:
    """(reasoning, answer) of a model turn.

    Everything before the first closing tag is reasoning (an opening tag there is dropped; a
    template may have put it in the prompt, as DeepSeek-R1's does); the answer is what follows,
    leading whitespace stripped. A turn that opens the reasoning and never closes it (cut off
    while thinking) is all reasoning and has no answer. A turn without the tags is all answer,
    unchanged.

    Args:
        text: the turn's decoded text.
        tags: (open, close); None: no split.

    Returns:
        (reasoning, answer).
    """
    if not tags:
        return "", text
    open_tag, close_tag = tags
    if close_tag in text:
        head, _, answer = text.partition(close_tag)
        if open_tag in head:
            before, _, head = head.partition(open_tag)
            head = before + head
        return head.strip(), answer.lstrip()
    if text.lstrip().startswith(open_tag):
        return text.lstrip()[len(open_tag):].strip(), ""
    return "", text


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn split into its content, its calls and what was malformed.

    Attributes:
        content: the text outside the tool calls and the reasoning (stripped): the answer.
        calls: the well-formed calls, in order (none from inside the reasoning).
        errors: one message per malformed call, written for the model to read.
        reasoning: the turn's reasoning (`split_reasoning`), "" when it has none.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()
    reasoning: str = ""


@runtime_checkable
class ToolCallParser(Protocol):
    """Turns a model turn's text into a ParsedTurn."""

    def parse(self, text: str) -> ParsedTurn:
        """Splits `text` into content, calls and malformed-call messages; never raises."""
        ...


def _call_from_json(payload: str, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a JSON object text, or an error message for the model."""
    shown = payload if len(payload) <= 200 else payload[:200] + "..."
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as error:
        return f"malformed tool call (invalid JSON: {error.msg} at character {error.pos}): {shown}"
    return _call_from_object(data, argument_keys, shown)


def _call_from_object(data, argument_keys: tuple[str, ...], shown: str) -> ToolCall | str:
    if not isinstance(data, Mapping):
        return f"malformed tool call (expected a JSON object with \"name\" and \"{argument_keys[0]}\"): {shown}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return f"malformed tool call (\"name\" must be a non-empty string): {shown}"
    arguments = next((data[k] for k in argument_keys if k in data), {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"malformed tool call (\"{argument_keys[0]}\" is a string that is not a JSON object): {shown}"
    if not isinstance(arguments, Mapping):
        return f"malformed tool call (\"{argument_keys[0]}\" must be a JSON object): {shown}"
    return ToolCall(name, dict(arguments))


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2/2.5/3, Hermes).

    Args:
        open_tag: the tag opening a call.
        close_tag: the tag closing it.
        reasoning_tags: split off first (`split_reasoning`); None: no reasoning.
    """

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>",
                 reasoning_tags: tuple[str, str] | None = THINK_TAGS):
        self.open_tag, self.close_tag = open_tag, close_tag
        self.reasoning_tags = reasoning_tags
        self._block = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        """Every closed block after the reasoning is a call (or an error); an unclosed opening tag is an error."""
        reasoning, text = split_reasoning(text, self.reasoning_tags)
        calls, errors = [], []
        for match in self._block.finditer(text):
            result = _call_from_json(match.group(1).strip(), ("arguments", "parameters"))
            (calls if isinstance(result, ToolCall) else errors).append(result)
        rest = self._block.sub("", text)
        if self.open_tag in rest:
            tail = rest[rest.index(self.open_tag):]
            errors.append(f"malformed tool call ({self.open_tag} without {self.close_tag}): {tail[:200]}")
            rest = rest[:rest.index(self.open_tag)]
        return ParsedTurn(rest.strip(), tuple(calls), tuple(errors), reasoning)


class Llama3JsonToolParser:
    """Llama 3.x JSON tool calls: the turn is `{"name": ..., "parameters": {...}}` (`;`-separated).

    Args:
        python_tag: a prefix the model may emit before calls (stripped).
        reasoning_tags: split off first (`split_reasoning`); None: no reasoning.
    """

    def __init__(self, python_tag: str = "<|python_tag|>", reasoning_tags: tuple[str, str] | None = THINK_TAGS):
        self.python_tag = python_tag
        self.reasoning_tags = reasoning_tags

    def parse(self, text: str) -> ParsedTurn:
        """A turn whose answer starts with `{` (after the python tag) is calls; anything else is content."""
        reasoning, text = split_reasoning(text, self.reasoning_tags)
        body = text.strip()
        if self.python_tag and body.startswith(self.python_tag):
            body = body[len(self.python_tag):].strip()
        if not body.startswith("{"):
            return ParsedTurn(text.strip(), reasoning=reasoning)
        decoder = json.JSONDecoder()
        calls, errors, position = [], [], 0
        while position < len(body):
            try:
                data, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError as error:
                shown = body[position:position + 200]
                errors.append(f"malformed tool call (invalid JSON: {error.msg} at character {error.pos}): {shown}")
                break
            result = _call_from_object(data, ("parameters", "arguments"), body[position:end][:200])
            (calls if isinstance(result, ToolCall) else errors).append(result)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return ParsedTurn("", tuple(calls), tuple(errors), reasoning)


class CompactToolParser:
    """One character starts a call; the rest of the turn (stripped) is its single argument.

    For tiny models on a character tokenizer: `CompactToolParser({"?": ("lookup", "key")})`
    reads "?b" as `lookup(key="b")`. A turn that does not start with a call character is
    content (an answer).

    Args:
        calls: call character -> (tool name, argument name).
        reasoning_tags: split off first (`split_reasoning`); None: no reasoning.
    """

    def __init__(self, calls: Mapping[str, tuple[str, str]], reasoning_tags: tuple[str, str] | None = THINK_TAGS):
        for char in calls:
            if len(char) != 1:
                raise ValueError(f"CompactToolParser: call prefix {char!r} must be one character")
        self.calls = dict(calls)
        self.reasoning_tags = reasoning_tags

    def parse(self, text: str) -> ParsedTurn:
        """"?b" -> lookup(key="b"); an empty argument is an error."""
        reasoning, text = split_reasoning(text, self.reasoning_tags)
        body = text.strip()
        if not body or body[0] not in self.calls:
            return ParsedTurn(body, reasoning=reasoning)
        name, argument = self.calls[body[0]]
        value = body[1:].strip()
        if not value:
            return ParsedTurn("", errors=(f"malformed tool call: {name} needs a {argument}",), reasoning=reasoning)
        return ParsedTurn("", (ToolCall(name, {argument: value}),), reasoning=reasoning)
