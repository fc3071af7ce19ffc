"""OpenEnv environments as rlbolt environments, in process (the optional `rlbolt[openenv]` extra).

An OpenEnv environment (the `openenv` package: `reset(seed=None, episode_id=None, **kw) ->
Observation`, `step(action, timeout_s=None) -> Observation`, each observation a pydantic model
with `done`, `reward`, `metadata` and fields of its own) is wrapped by `OpenEnvEnvironment`,
which is an `rlbolt.agents.Environment`:

- the opening: `env.reset(**reset_kwargs)`'s observation as text becomes the opening user
  message (or the messages you give as `opening`);
- each model turn: `action(turn_text)` builds the environment's action (a function you
  supply: OpenEnv actions are typed, e.g. `lambda text: EchoAction(message=text)`); a turn it
  refuses (raises, e.g. a pydantic ValidationError) is answered with the error text and counts
  as a tool error, the episode goes on;
- the observation -> `StepResult`: its text (`observation_text`, replaceable) is the reply the
  model reads next (rendered as a token delta by `run_episodes`), `reward` (None counts as 0)
  is the step's reward, `done` ends the episode;
- MCP tools: an environment with MCP tools (an `MCPEnvironment`, or `mcp=True`) has them listed
  once (`ListToolsAction`) and rendered into the prompt (`tools=`); the calls in a turn
  (parsed by `tool_parser`, Qwen's `<tool_call>` format by default) become `CallToolAction`s,
  stepped one after the other, each answered by a "tool" message (its result, or the error the
  environment reported). A turn without calls goes to `action` (or, when there is none, is the
  final answer and ends the episode: score it with a reward term on the transcript).

Sync clients of remote OpenEnv servers (`SomeEnv(base_url=...).sync()`, whose `step` returns
`StepResult(observation, reward, done)`) work the same way.

Failure isolation: `run_episodes` ends an episode whose `step` raises or outlives
`step_timeout_s` (end reason `env_error`), so an OpenEnv environment that crashes or hangs
costs only its episode. `reset` runs with `reset_timeout_s` here (a hang becomes an error that
names the environment instead of a stuck rollout). The wrapped environment is closed when its
episode ends with `done`, or when the wrapper is garbage-collected.

Nothing here imports `openenv` until an MCP action class is needed and none was passed
(`mcp_actions=`), so the mapping logic runs, and is tested, without the package.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlbolt.agents.environment import Message, StepResult
from rlbolt.agents.parsers import HermesToolParser, ParsedTurn, ToolCallParser
from rlbolt.agents.tools import Tool, result_text

__all__ = ["OpenEnvEnvironment", "observation_text", "tool_result_text", "mcp_action_types"]

_BASE_FIELDS = frozenset({"done", "reward", "metadata"})


def _own_fields(observation: Any) -> dict[str, Any]:
    """An observation's fields other than done / reward / metadata (pydantic, dataclass, dict or plain object)."""
    if isinstance(observation, Mapping):  # a generic client's observation
        return {k: v for k, v in observation.items() if k not in _BASE_FIELDS}
    names = getattr(type(observation), "model_fields", None)  # pydantic v2: the class's declared fields
    if names is None and dataclasses.is_dataclass(observation):
        names = [f.name for f in dataclasses.fields(observation)]
    if names is None:
        names = list(getattr(observation, "__dict__", {}))
    return {name: getattr(observation, name) for name in names if name not in _BASE_FIELDS}


def observation_text(observation: Any) -> str:
    """The default text of an observation: its own fields (done, reward and metadata left out).

    One string field is the text itself (`EchoObservation(echoed_message="hi")` -> "hi");
    anything else is the fields as JSON (`{"board": ..., "legal_moves": [...]}`): nested models
    as their fields, arrays as lists, other values JSON cannot hold with `str()`. A plain string
    observation is returned as is.

    Args:
        observation: an OpenEnv observation (or any object with fields).

    Returns:
        The text the model reads.
    """
    if observation is None:
        return ""
    if isinstance(observation, str):
        return observation
    fields = _own_fields(observation)
    if not fields:
        return ""
    if len(fields) == 1:
        (value,) = fields.values()
        if isinstance(value, str):
            return value
    return json.dumps(fields, ensure_ascii=False, default=_jsonable)


def _jsonable(value: Any) -> Any:
    """What JSON cannot hold directly: a pydantic model as its fields, an array as a list, else str()."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _get(value: Any, key: str, default: Any = None) -> Any:
    """`value[key]` for a mapping, `value.key` otherwise (observations arrive as models or dicts)."""
    if isinstance(value, Mapping):
        return value.get(key, default)
    return getattr(value, key, default)


def tool_result_text(observation: Any) -> tuple[str, bool]:
    """The text of a `CallToolObservation` and whether the call succeeded.

    Reads, in order: the framework error (`error`: tool not found, invalid arguments, time-out,
    execution error), the result's text content blocks (an MCP `CallToolResult`, or its dict
    over HTTP; `is_error` / `isError` marks a failed call), the result's `data`, else the
    result itself.

    Args:
        observation: what `env.step(CallToolAction(...))` returned.

    Returns:
        (text, ok).
    """
    name = _get(observation, "tool_name", "?")
    error = _get(observation, "error")
    if error is not None:
        kind = _get(error, "error_type", "error")
        kind = getattr(kind, "value", kind)
        return f"tool {name} failed ({kind}): {_get(error, 'message', error)}", False
    result = _get(observation, "result")
    failed = bool(_get(result, "is_error", False) or _get(result, "isError", False)) if result is not None else False
    content = _get(result, "content") if result is not None else None
    if isinstance(content, (list, tuple)):
        parts = [_get(block, "text") for block in content]
        text = "\n".join(p for p in parts if isinstance(p, str))
        if text or not parts:
            return (f"tool {name} failed: {text}" if failed else text), not failed
    data = _get(result, "data") if result is not None and not isinstance(result, (str, bytes)) else None
    value = data if data is not None else result
    text, _ = result_text(value, 1 << 30)
    return (f"tool {name} failed: {text}" if failed else text), not failed


def mcp_action_types() -> tuple[type, type]:
    """(ListToolsAction, CallToolAction) from the installed `openenv` package.

    Raises:
        ImportError: `openenv` is not installed (one line naming the extra).
    """
    try:
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
    except ImportError as error:
        raise ImportError("OpenEnvEnvironment: MCP tools need the openenv package; pip install 'rlbolt[openenv]', "
                          "or pass mcp_actions=(ListToolsAction, CallToolAction)") from error
    return ListToolsAction, CallToolAction


def _is_mcp_environment(env: Any) -> bool:
    try:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
    except ImportError:
        return False
    return isinstance(env, MCPEnvironment)


def _call_with_timeout(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """fn() on a daemon thread; raises TimeoutError naming `what` when it outlives `timeout_s`."""
    slot: dict = {}

    def work():
        try:
            slot["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            slot["error"] = error

    thread = threading.Thread(target=work, daemon=True, name="rlbolt-openenv")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout_s:g} s")
    if "error" in slot:
        raise slot["error"]
    return slot.get("value")


def _close_quietly(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


def _observation(result: Any) -> Any:
    """The observation of what reset/step returned: a client's StepResult holds it, a server returns it."""
    if hasattr(result, "observation") and not hasattr(type(result), "model_fields"):
        return result.observation  # a client StepResult (a dataclass); observations are pydantic models
    return result


def _tool_schema(tool: Any) -> dict:
    """An MCP tool listing (name, description, input_schema) -> the function schema chat templates render."""
    parameters = _get(tool, "input_schema") or _get(tool, "inputSchema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": str(_get(tool, "name")),
                                             "description": str(_get(tool, "description") or ""),
                                             "parameters": dict(parameters)}}


class OpenEnvEnvironment:
    """One OpenEnv environment as an rlbolt `Environment` for one episode (see the module docstring).

    Args:
        env: an OpenEnv `Environment` instance (in process), or a sync client of one.
        action: model turn text -> the environment's action; raising refuses the turn (the model
            reads the error). None: only MCP tool calls are actions, and a turn without calls
            ends the episode.
        opening: the opening messages, or a function of the reset observation's text returning
            them; None: one user message holding that text.
        reset_kwargs: keyword arguments of `env.reset` (e.g. `seed`, `episode_id`, a task index).
        observation_text: observation -> the text the model reads (default `observation_text`).
        mcp: the environment takes `ListToolsAction` / `CallToolAction`; None: whether it is an
            `openenv` `MCPEnvironment`.
        tool_parser: reads tool calls out of a turn (with MCP tools); default `HermesToolParser()`.
        mcp_actions: the (ListToolsAction, CallToolAction) classes; default the installed
            `openenv`'s.
        action_timeout_s: passed to `env.step(..., timeout_s=)` (OpenEnv's MCP tool calls honour
            it and report a time-out the model reads); None passes nothing.
        reset_timeout_s: seconds `env.reset` may take (then TimeoutError, which `run_episodes`
            reports as a set-up error naming the episode).
        max_calls_per_turn: calls beyond it in one turn are not run (the model reads an error each).
        max_text_chars: replies and tool results longer than this are cut (with a note).
        reply_role: the role of the environment's replies ("user").
        tool_role: the role of tool results ("tool").

    Raises:
        ValueError: an argument is out of range, or the environment's tool listing failed.
    """

    def __init__(self, env: Any, *, action: Callable[[str], Any] | None = None,
                 opening: Sequence[Message] | Callable[[str], Sequence[Message]] | None = None,
                 reset_kwargs: Mapping[str, Any] | None = None,
                 observation_text: Callable[[Any], str] = observation_text, mcp: bool | None = None,
                 tool_parser: ToolCallParser | None = None, mcp_actions: tuple[type, type] | None = None,
                 action_timeout_s: float | None = None, reset_timeout_s: float = 60.0, max_calls_per_turn: int = 8,
                 max_text_chars: int = 4096, reply_role: str = "user", tool_role: str = "tool"):
        for name, value in (("max_calls_per_turn", max_calls_per_turn), ("max_text_chars", max_text_chars)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"OpenEnvEnvironment: {name}={value!r} must be an int >= 1")
        for name, value in (("reset_timeout_s", reset_timeout_s), ("action_timeout_s", action_timeout_s)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"OpenEnvEnvironment: {name}={value!r} must be a positive number of seconds")
        self.env = env
        self.action = action
        self.opening = opening
        self.reset_kwargs = dict(reset_kwargs or {})
        self.observation_text = observation_text
        self.action_timeout_s = action_timeout_s
        self.reset_timeout_s = float(reset_timeout_s)
        self.max_calls_per_turn = max_calls_per_turn
        self.max_text_chars = max_text_chars
        self.reply_role, self.tool_role = reply_role, tool_role
        self.mcp = _is_mcp_environment(env) if mcp is None else bool(mcp)
        self.tool_parser = tool_parser or HermesToolParser()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_quietly, env)
        self.tools: list[Tool] = []
        if self.mcp:
            self._list_tools_action, self._call_tool_action = mcp_actions or mcp_action_types()
            self.tools = self._discover_tools()

    def _discover_tools(self) -> list[Tool]:
        observation, _, _ = self._step(self._list_tools_action())
        listed = _get(observation, "tools")
        error = (_get(observation, "metadata") or {}).get("error") if not listed else None
        if listed is None or error:
            raise ValueError(f"OpenEnvEnvironment: listing the MCP tools of {type(self.env).__name__} failed "
                             f"({error or 'no tools field'}); pass mcp=False for an environment without MCP tools")
        tools = []
        for listing in listed:
            schema = _tool_schema(listing)
            name = schema["function"]["name"]
            tools.append(Tool(name, functools.partial(self._call_tool_text, name), schema))
        return tools

    def _call_tool_text(self, name: str, **arguments: Any) -> str:
        """One MCP call's text (what a `Tool`'s fn does; the episode path is `step`)."""
        observation, _, _ = self._step(self._call_tool_action(tool_name=name, arguments=arguments))
        text, ok = tool_result_text(observation)
        if not ok:
            raise RuntimeError(text)
        return text

    def _step(self, action: Any) -> tuple[Any, float, bool]:
        """env.step(action) -> (observation, reward, done); a client's StepResult is unpacked."""
        if self.action_timeout_s is None:
            result = self.env.step(action)
        else:
            result = self.env.step(action, timeout_s=self.action_timeout_s)
        observation = _observation(result)
        reward = _get(result, "reward")
        return observation, 0.0 if reward is None else float(reward), bool(_get(result, "done", False))

    def _text(self, text: str) -> str:
        return result_text(text, self.max_text_chars)[0]

    def reset(self) -> list[dict]:
        """Resets the environment; the opening messages (see `opening`)."""
        result = _call_with_timeout(lambda: self.env.reset(**self.reset_kwargs), self.reset_timeout_s,
                                    f"{type(self.env).__name__}.reset")
        observation = _observation(result)
        if self.opening is not None and not callable(self.opening):
            return [dict(m) for m in self.opening]
        text = self._text(self.observation_text(observation))
        if callable(self.opening):
            return [dict(m) for m in self.opening(text)]
        return [{"role": self.reply_role, "content": text}]

    def step(self, turn_text: str) -> StepResult:
        """Maps the turn to MCP tool calls or the environment's action and the observation back."""
        if self.mcp:
            try:
                parsed = self.tool_parser.parse(turn_text)
            except Exception as error:  # noqa: BLE001 - a user parser's bug costs the turn, not the run
                parsed = ParsedTurn("", errors=(f"the tool-call parser failed: {type(error).__name__}: {error}",))
            if parsed.calls or parsed.errors:
                return self._tool_turn(parsed)
        if self.action is None:
            self.close()
            return StepResult(done=True)
        try:
            action = self.action(turn_text)
        except Exception as error:  # noqa: BLE001 - the model's malformed turn, answered with the reason
            reply = self._text(f"invalid action ({type(error).__name__}): {error}")
            return StepResult(messages=[{"role": self.reply_role, "content": reply}], tool_errors=1)
        observation, reward, done = self._step(action)
        text = self._text(self.observation_text(observation))
        if done:
            self.close()
        return StepResult(messages=[{"role": self.reply_role, "content": text}] if text else [], reward=reward,
                          done=done)

    def _tool_turn(self, parsed: ParsedTurn) -> StepResult:
        known = {t.name for t in self.tools}
        messages = [{"role": self.tool_role, "name": "error", "content": self._text(e)} for e in parsed.errors]
        errors, reward, done, seconds = len(parsed.errors), 0.0, False, 0.0
        for index, call in enumerate(parsed.calls):
            if done:
                break
            if index >= self.max_calls_per_turn:
                text, ok = (f"too many tool calls in one turn (at most {self.max_calls_per_turn}); {call.name} "
                            "was not run"), False
            elif call.name not in known:
                text, ok = f"unknown tool {call.name!r}; the tools are {sorted(known)}", False
            else:
                started = time.monotonic()
                observation, step_reward, done = self._step(
                    self._call_tool_action(tool_name=call.name, arguments=dict(call.arguments)))
                seconds += time.monotonic() - started
                reward += step_reward
                text, ok = tool_result_text(observation)
            errors += not ok
            messages.append({"role": self.tool_role, "name": call.name, "content": self._text(text)})
        if done:
            self.close()
        return StepResult(messages=messages, reward=reward, done=done, tool_calls=len(parsed.calls),
                          tool_errors=errors, tool_time_s=seconds)

    def close(self) -> None:
        """Closes the wrapped environment (once)."""
        if not self._closed:
            self._closed = True
            self._finalizer()
