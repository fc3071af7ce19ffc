"""Format rewards: does the completion reason in `<think>` tags, then answer in `<answer>` tags?

Two variants share one checker:

- **strict** (`strict=True`): 1.0 only when the whole completion (surrounding whitespace aside)
  is exactly `<think>...</think>` followed by `<answer>...</answer>`, each tag once and both
  blocks non-empty; otherwise 0.0.
- **lenient** (default): partial credit, 0.25 for each of
  1. one well-formed think block (one opening tag, then one closing tag) with content,
  2. one well-formed answer block with non-empty content,
  3. both blocks are well-formed and the think block closes before the answer block opens,
  4. ordered as in 3, with nothing but whitespace outside the two blocks.
  A completion earns 1.0 exactly when it passes the strict check, so the two variants agree at
  the top and the lenient one gives a gradient toward it early in training.

Tag names are configurable (`think_tag="reasoning"`, `answer_tag="solution"`); when the chat
template already opens the think block in the prompt, pass `think_prefilled=True` and the
completion is checked as if it began with the opening tag.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from rlbolt.rewards.base import RewardFn

__all__ = ["digit_fraction_reward", "format_reward", "make_format_reward"]


def _blocks(text: str, tag: str) -> tuple[int, int, str] | None:
    """(start, end, content) of the single well-formed `<tag>...</tag>` block, else None."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    if text.count(opening) != 1 or text.count(closing) != 1:
        return None
    start, close = text.index(opening), text.index(closing)
    if close < start:
        return None
    return start, close + len(closing), text[start + len(opening) : close]


def format_reward(
    completion: str,
    sample: Mapping[str, Any] | None = None,
    *,
    think_tag: str = "think",
    answer_tag: str = "answer",
    strict: bool = False,
    think_prefilled: bool = False,
) -> float:
    """Scores the think-then-answer layout of one completion (see the module docstring).

    Args:
        completion: the generated text.
        sample: the prompt row (unused; kept for the `RewardFn` signature).
        think_tag: name of the reasoning tag, without angle brackets.
        answer_tag: name of the answer tag, without angle brackets.
        strict: all-or-nothing instead of partial credit.
        think_prefilled: the prompt already ends with `<think_tag>`, so the completion starts
            inside the think block.

    Returns:
        A score in {0.0, 0.25, 0.5, 0.75, 1.0} (lenient) or {0.0, 1.0} (strict).
    """
    for field, tag in (("think_tag", think_tag), ("answer_tag", answer_tag)):
        if not re.fullmatch(r"[A-Za-z_][\w\-]*", tag):
            raise ValueError(f"format_reward: {field}={tag!r} must be a bare tag name like 'think'")
    text = (f"<{think_tag}>" if think_prefilled else "") + completion
    think = _blocks(text, think_tag)
    answer = _blocks(text, answer_tag)
    ordered = think is not None and answer is not None and think[1] <= answer[0]
    layout_clean = ordered and (
        text[: think[0]] + text[think[1] : answer[0]] + text[answer[1] :]
    ).strip() == ""
    checks = [
        think is not None and think[2].strip() != "",
        answer is not None and answer[2].strip() != "",
        ordered,
        layout_clean,
    ]
    if strict:
        return 1.0 if all(checks) else 0.0
    return 0.25 * sum(checks)


def make_format_reward(
    *,
    think_tag: str = "think",
    answer_tag: str = "answer",
    strict: bool = False,
    think_prefilled: bool = False,
) -> RewardFn:
    """Binds `format_reward`'s options into a two-argument `RewardFn` (picklable for processes).

    Args:
        think_tag: name of the reasoning tag.
        answer_tag: name of the answer tag.
        strict: all-or-nothing instead of partial credit.
        think_prefilled: the prompt already opens the think block.

    Returns:
        A reward function `(completion, sample) -> float`.
    """
    format_reward("", think_tag=think_tag, answer_tag=answer_tag)  # validates the tag names now
    return functools.partial(
        format_reward,
        think_tag=think_tag,
        answer_tag=answer_tag,
        strict=strict,
        think_prefilled=think_prefilled,
    )


def digit_fraction_reward(completion: str, sample: Mapping[str, Any] | None = None) -> float:
    """Fraction of the completion's non-space characters that are digits, in [0, 1].

    A dense, always-varying signal: the tiny random model never answers a GSM8K question, so a
    CPU smoke run needs something its samples differ on. Keep its weight small (or 0) for real
    runs; a policy can raise it by printing numbers.

    Args:
        completion: the generated text.
        sample: unused (the reward needs only the text).

    Returns:
        digits / non-space characters, 0.0 for an empty completion.
    """
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
