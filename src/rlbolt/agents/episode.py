"""Token-in/token-out: one episode's training sequence, and environment text rendered as a token delta.

The rule: the sequence trained on is exactly the tokens the sampler produced, with the
environment's tokens appended after them, never a re-tokenisation of the whole conversation.
Chat templates are not append-only (Qwen3 drops the `<think>` reasoning of earlier assistant
turns; some templates restyle earlier tool results), and a tokenizer may merge characters across
a turn boundary differently from how the model emitted them. Training on a re-rendered or
re-tokenised conversation would score tokens the model never sampled, with the sampler's logps
of other tokens: a silently wrong importance ratio.

How environment text becomes tokens (`TurnRenderer`): the new messages are rendered *after a
fixed stub conversation*, `[user: STUB, assistant: MARK]`, not after the episode's real history.
`render(stub + new, add_generation_prompt=True)` is cut after the marker; what follows is the
template's close of an assistant turn, the new messages, and the header of the next assistant
turn. That delta is tokenised once and appended. Why a stub and not
`render(history + new)[len(render(history)):]`: with a template that rewrites earlier turns
the full render of the history is not a prefix of the longer render, so the suffix would be
garbage; the stub's assistant turn is last in both renders and nothing before the marker can
change the text after it. The stub also keeps the cost of a turn independent of the episode's
length. When the model's turn ended with the stop token (e.g. `<|im_end|>`), the template's
close starts with that token's text, which the sampled sequence already holds: it is dropped
from the delta. A turn cut at `max_turn_tokens` keeps the whole close, so the next turn starts
after a properly closed assistant message.

`EpisodeState` holds one episode's tokens: `tokens` (sampled and environment ids after the
prompt), `model_mask` (True exactly on sampled ids, each turn's stop token included),
`logps` (the sampler's logps; 0 on environment ids).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TurnRenderer", "EpisodeState"]

_USER_STUB = "rlbolt-user-stub"
_TURN_MARK = "rlbolt-turn-mark"


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class TurnRenderer:
    """Renders opening prompts and environment deltas with a tokenizer's chat template.

    Args:
        tokenizer: an `rlbolt.data.tokenizers.Tokenizer` (`apply_chat_template`, `encode`, `decode`).
        tools: tool schemas passed as `tools=` to templates that take it (ignored by the tiny
            built-in tokenizers, whose "template" just joins contents).
        template_kwargs: more template variables (e.g. `enable_thinking=False`), for templates
            that take them (the tiny built-in tokenizers' plain join takes none).
        stop_text: the text of the stop token as the template writes it; default: the
            tokenizer's eos token decoded with special tokens kept.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping] = (), template_kwargs: Mapping[str, Any] | None = None,
                 stop_text: str | None = None):
        self.tokenizer = tokenizer
        # Variables a template function cannot take (the built-in tokenizers' plain join) are left out.
        self.kwargs = {k: v for k, v in (template_kwargs or {}).items() if _accepts(tokenizer.apply_chat_template, k)}
        if tools and _accepts(tokenizer.apply_chat_template, "tools"):
            self.kwargs["tools"] = [dict(t) for t in tools]
        if stop_text is None:
            stop_text = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
        self.stop_text = stop_text
        self._cache: dict[tuple, list[int]] = {}

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool) -> str:
        """The chat template's text for `messages` (with this renderer's tools and variables)."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  **self.kwargs)

    def prompt_ids(self, messages: Sequence[Mapping]) -> list[int]:
        """The opening prompt: `messages` rendered with the generation prompt, tokenised."""
        if not messages:
            raise ValueError("an environment's reset() returned no messages; return the opening messages, or None "
                             "to use the row's prompt")
        return list(self.tokenizer.encode(self.render(messages, add_generation_prompt=True)))

    def delta_text(self, messages: Sequence[Mapping], turn_stopped: bool) -> str:
        """The text appended after a model turn: close of the turn (less the stop token's text when
        the turn stopped on it), `messages`, and the next assistant header (module docstring)."""
        stub = [{"role": "user", "content": _USER_STUB}, {"role": "assistant", "content": _TURN_MARK}]
        full = self.render(stub + [dict(m) for m in messages], add_generation_prompt=True)
        if full.count(_TURN_MARK) != 1:
            raise ValueError("the chat template does not render an assistant message's content verbatim (once), so "
                             "environment text cannot be rendered as a delta; use a template that does")
        delta = full[full.index(_TURN_MARK) + len(_TURN_MARK):]
        if turn_stopped and self.stop_text and delta.startswith(self.stop_text):
            delta = delta[len(self.stop_text):]
        return delta

    def delta_ids(self, messages: Sequence[Mapping], turn_stopped: bool) -> list[int]:
        """`delta_text` tokenised once (cached by content: many episodes get the same replies)."""
        key = (turn_stopped, tuple(tuple(sorted((k, str(v)) for k, v in m.items())) for m in messages))
        ids = self._cache.get(key)
        if ids is None:
            ids = list(self.tokenizer.encode(self.delta_text(messages, turn_stopped)))
            if len(self._cache) < 4096:
                self._cache[key] = ids
        return list(ids)


@dataclasses.dataclass
class EpisodeState:
    """One episode's tokens and bookkeeping while `run_episodes` runs it.

    Attributes:
        prompt: the opening prompt's ids.
        tokens: every id after the prompt: sampled, then environment, then sampled, ...
        model_mask: True on sampled ids (each turn's stop token included), False on environment ids.
        logps: the sampler's logp of each sampled id; 0.0 on environment ids.
        messages: the conversation as text (opening messages, each turn, each reply).
        reward: the sum of the environment's step rewards.
        turns: model turns taken.
        tool_calls: well-formed tool calls.
        tool_errors: malformed or failed calls.
        tool_time_s: time spent in tools.
        end_reason: None while running; then "done" (the environment ended it), "max_turns",
            "budget" (max_total_tokens spent) or "env_error" (its step raised or hung).
        error: the environment's error text when end_reason is "env_error".
    """

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    model_mask: list[bool] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time_s: float = 0.0
    end_reason: str | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        """The episode has ended."""
        return self.end_reason is not None

    def history(self) -> list[int]:
        """What the next turn is sampled after: the prompt and every id so far."""
        return self.prompt + self.tokens

    def add_model_turn(self, ids: Sequence[int], logps: Sequence[float]) -> None:
        """Appends sampled ids with their sampler logps (mask 1)."""
        self.tokens.extend(int(i) for i in ids)
        self.model_mask.extend([True] * len(ids))
        self.logps.extend(float(x) for x in logps)

    def add_env_tokens(self, ids: Sequence[int]) -> None:
        """Appends environment ids (mask 0, logp 0)."""
        self.tokens.extend(int(i) for i in ids)
        self.model_mask.extend([False] * len(ids))
        self.logps.extend([0.0] * len(ids))
