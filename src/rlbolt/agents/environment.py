"""The environment protocol: what a multi-turn episode talks to, and `ToolEnvironment`, the common case.

An environment lives for one episode. A factory builds it from the prompt row
(`Factory(row: dict) -> Environment`, named in a config as `package.module:Factory`); then

- `reset()` returns the opening messages (`[{"role": "user", "content": ...}, ...]`), or None
  to use the prompt the caller encoded from the row as it is;
- `step(turn_text)` gets each model turn's text (a reasoning model's `<think>` part split off:
  `run_episodes(reasoning_tags=)`) and returns a `StepResult`: the messages to append (tool
  results, the environment's reply), the reward earned by this step, and whether the episode is
  over. It runs after every turn, the `max_turns`-th included (its reward counts; a reply it
  returns then is recorded in the messages but no ids are appended, since no turn follows);
- an optional `tools` attribute (a sequence of `rlbolt.agents.Tool`) is rendered into the
  opening prompt through the chat template's `tools=` (for tokenizers whose template takes it).

Environments are plain in-process Python objects; they need not be thread-safe (each episode
has its own) and `run_episodes` isolates a step that raises or hangs (the episode ends with
end reason "env_error", the batch carries on). A training run logs every such error and stops
when every episode failed in `rollout.env_max_failed_batches` consecutive batches
(`rlbolt.agents.failures`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rlbolt.config.fields import ConfigError
from rlbolt.config.references import import_reference
from rlbolt.agents.failures import EnvFailureError
from rlbolt.agents.parsers import ParsedTurn, ToolCallParser
from rlbolt.agents.tools import Tool, ToolRunner, as_tool

__all__ = ["Message", "StepResult", "Environment", "EnvFactory", "ToolEnvironment", "load_env_factory",
           "EnvFailureError"]

Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn.

    Attributes:
        messages: messages to append after the model's turn (role "tool" for tool results,
            "user" for the environment's reply); may be empty.
        reward: reward earned by this step (an episode's reward is the sum over its steps).
        done: the episode is over (no further model turn).
        tool_calls: well-formed tool calls made in this turn (metrics).
        tool_errors: malformed calls and calls that failed (bad arguments, raised, timed out).
        tool_time_s: wall time spent in tools.
    """

    messages: Sequence[Message] = ()
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time_s: float = 0.0


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    def reset(self) -> Sequence[Message] | None:
        """The opening messages, or None to use the caller's prompt for the row."""
        ...

    def step(self, turn_text: str) -> StepResult:
        """Reacts to one model turn (its decoded text, special tokens dropped)."""
        ...


EnvFactory = Callable[[Mapping[str, Any]], Environment]


def load_env_factory(reference: str | EnvFactory) -> EnvFactory:
    """An environment factory from `"package.module:Name"` (or a callable, returned as is).

    Args:
        reference: an importable reference, or the factory itself.

    Returns:
        The callable `Factory(row) -> Environment`.

    Raises:
        ConfigError: the reference is not of the form `package.module:Name`, does not import, or
            is not callable (one line naming `rollout.env`).
    """
    if callable(reference):
        return reference
    factory = import_reference(str(reference), "rollout.env")  # ConfigError (a ValueError) naming the field
    if not callable(factory):
        raise ConfigError(f"rollout.env={reference!r} is a {type(factory).__name__}, not a callable row -> Environment")
    return factory


def _default_format(text: str) -> str:
    return text


class ToolEnvironment:
    """Tools plus a final-answer check: the common agentic task.

    Each model turn is parsed; a turn with tool calls gets one "tool" message per call (the
    result, or the error text for a malformed or failed call) and the episode goes on; a turn
    with only malformed calls gets the error messages; a turn without calls is the final answer,
    scored by `score(answer)`, and ends the episode.

    Args:
        messages: the opening messages (e.g. a system prompt and the user's question).
        tools: functions (or `Tool`s) the model may call.
        score: final answer text -> reward. It gets the answer alone: `run_episodes` and the
            shipped parsers split a reasoning model's `<think>` part off (`ParsedTurn.content`).
        parser: reads calls out of a turn (`HermesToolParser()` for Qwen, ...).
        runner: runs the calls (time-out, result size, isolation); default `ToolRunner()`.
        max_calls_per_turn: calls beyond it are not run (the model reads an error for each).
        format_result: tool result text -> message content (default: the text).
        format_error: error text -> message content (default: the text); tiny models on a
            character tokenizer map it to a character they know.
        tool_role: the role of tool-result messages ("tool" works with Qwen and Llama 3 templates).
    """

    def __init__(self, messages: Sequence[Message], tools: Sequence[Callable | Tool], score: Callable[[str], float],
                 parser: ToolCallParser, *, runner: ToolRunner | None = None, max_calls_per_turn: int = 8,
                 format_result: Callable[[str], str] = _default_format,
                 format_error: Callable[[str], str] = _default_format, tool_role: str = "tool"):
        self.messages = [dict(m) for m in messages]
        self.tools = [as_tool(t) for t in tools]
        self._by_name = {t.name: t for t in self.tools}
        self.score = score
        self.parser = parser
        self.runner = runner or ToolRunner()
        self.max_calls_per_turn = max_calls_per_turn
        self.format_result, self.format_error = format_result, format_error
        self.tool_role = tool_role

    def reset(self) -> list[dict]:
        """The opening messages."""
        return [dict(m) for m in self.messages]

    def _tool_message(self, name: str, text: str) -> dict:
        return {"role": self.tool_role, "name": name, "content": text}

    def step(self, turn_text: str) -> StepResult:
        """Runs the turn's calls, or scores it as the final answer when it has none."""
        try:
            parsed = self.parser.parse(turn_text)
        except Exception as error:  # noqa: BLE001 - a user parser's bug costs the turn, not the run
            parsed = ParsedTurn("", errors=(f"the tool-call parser failed: {type(error).__name__}: {error}",))
        if not parsed.calls and not parsed.errors:
            return StepResult(reward=float(self.score(parsed.content)), done=True)
        replies = [self._tool_message("error", self.format_error(e)) for e in parsed.errors]
        errors = len(parsed.errors)
        runnable, slots = [], []
        for index, call in enumerate(parsed.calls):
            tool = self._by_name.get(call.name)
            if index >= self.max_calls_per_turn:
                problem = (f"too many tool calls in one turn (at most {self.max_calls_per_turn}); "
                           f"{call.name} was not run")
            elif tool is None:
                problem = f"unknown tool {call.name!r}; the tools are {sorted(self._by_name)}"
            else:
                runnable.append((tool, call.arguments))
                slots.append(len(replies))
                replies.append(None)
                continue
            errors += 1
            replies.append(self._tool_message(call.name, self.format_error(problem)))
        outcomes = self.runner.run_many(runnable)
        seconds = 0.0
        for slot, (tool, _), outcome in zip(slots, runnable, outcomes):
            seconds += outcome.seconds
            errors += not outcome.ok
            text = self.format_result(outcome.text) if outcome.ok else self.format_error(outcome.text)
            replies[slot] = self._tool_message(tool.name, text)
        return StepResult(messages=replies, tool_calls=len(parsed.calls), tool_errors=errors, tool_time_s=seconds)
