"""Tools: plain Python callables, their JSON schema, and a runner that never lets one hurt an episode.

A tool is a function with type hints and a Google-style docstring:

    def lookup(key: str) -> str:
        '''Looks a key up in the table.

        Args:
            key: the key to read.
        '''

`tool_schema(lookup)` turns it into the OpenAI-style function schema that chat templates render
(`tools=[...]`): type hints become JSON types (`str` string, `int` integer, `float` number,
`bool` boolean, `list[X]` array of X, `dict` object, `Literal[...]` enum, `X | None` X, not
required when it has a default), the docstring's first paragraph the description and its
`Args:` entries the parameters' descriptions.

`ToolRunner.run_many` runs calls concurrently, each on a daemon thread with a time-out. Whatever
a tool does (raises, hangs, returns 10 MB, returns bytes that are not UTF-8, returns an object
whose `str()` raises) becomes a `ToolOutcome` whose text the model reads: a stuck thread is
abandoned (threads cannot be killed; after `max_stuck` of them calls fail at once with a message
saying so), a long result is cut to `max_result_chars` with a note. A tool that must survive
`os._exit` or C code holding the GIL belongs in a process: run code through
`rlbolt.rewards.sandbox.run_python_sandboxed` (see `python_tool`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Tool", "ToolOutcome", "ToolRunner", "tool_schema", "as_tool", "result_text", "python_tool"]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array", type(None): "null"}


def _json_type(annotation: Any, where: str) -> dict:
    """A type hint -> a JSON schema fragment; one-line error naming `where` for what it cannot map."""
    if annotation is Any:
        return {}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
        return {"anyOf": [_json_type(a, where) for a in options]}
    if origin in (list, tuple, Sequence):
        return {"type": "array", **({"items": _json_type(args[0], where)} if args and args[0] is not Ellipsis else {})}
    if origin in (dict, Mapping):
        return {"type": "object"}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    raise ValueError(f"{where}: type hint {annotation!r} has no JSON type; use str, int, float, bool, list[...], "
                     "dict, Literal[...] or X | None")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) of a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    sections = re.split(r"^(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$", doc, flags=re.MULTILINE)
    description = " ".join(sections[0].split())
    args: dict[str, str] = {}
    for title, body in zip(sections[1::2], sections[2::2]):
        if title not in ("Args", "Arguments"):
            continue
        current = None
        for line in body.splitlines():
            match = re.match(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= args_indent):
                current = match.group(1).lstrip("*")
                args_indent = len(line) - len(line.lstrip())
                args[current] = match.group(3).strip()
            elif current is not None and line.strip():
                args[current] = (args[current] + " " + line.strip()).strip()
    return description, args


def tool_schema(fn: Callable, name: str | None = None) -> dict:
    """The function schema a chat template renders for `fn` (`{"type": "function", "function": {...}}`).

    Args:
        fn: a function whose parameters all have type hints (no *args / **kwargs).
        name: the tool's name; default `fn.__name__`.

    Returns:
        `{"type": "function", "function": {"name", "description", "parameters": {"type": "object",
        "properties", "required"}}}`.

    Raises:
        ValueError: a parameter without a type hint, a hint with no JSON type, or *args/**kwargs.
    """
    name = name or getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise ValueError(f"tool {fn!r} needs a name: use a def'd function or pass name=")
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable forward references: fall back to the raw annotations
        hints = {k: p.annotation for k, p in signature.parameters.items()}
    description, arg_docs = _docstring_parts(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for pname, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {name}: *{pname} / **{pname} cannot be described to a model; list the "
                             "parameters by name")
        hint = hints.get(pname, param.annotation)
        if hint is inspect.Parameter.empty:
            raise ValueError(f"tool {name}: parameter {pname!r} has no type hint; annotate it (e.g. {pname}: str)")
        prop = _json_type(hint, f"tool {name}, parameter {pname!r}")
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable and the schema the model sees.

    Attributes:
        name: what the model calls it by.
        fn: the function, called with the call's arguments as keywords.
        schema: its `tool_schema`.
    """

    name: str
    fn: Callable
    schema: dict


def as_tool(fn: Callable | Tool, name: str | None = None) -> Tool:
    """A `Tool` from a function (its schema from its signature and docstring), or the Tool itself."""
    if isinstance(fn, Tool):
        return fn
    schema = tool_schema(fn, name)
    return Tool(schema["function"]["name"], fn, schema)


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """What one call gave the model.

    Attributes:
        text: what the model reads (the result, or the error message).
        ok: the tool returned (False: bad arguments, it raised, timed out, or could not run).
        error: the error message when not ok.
        seconds: wall time the call took (the time-out when it timed out).
        truncated: the result was cut to `max_result_chars`.
    """

    text: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    truncated: bool = False


def result_text(value: Any, max_chars: int) -> tuple[str, bool]:
    """A tool's return value as valid text of at most `max_chars` characters (plus a note when cut).

    str stays as is (lone surrogates replaced), bytes are decoded as UTF-8 with bad bytes replaced,
    None is "", other values are JSON when they serialise, else `str()`.

    Returns:
        (text, truncated).
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value[:4 * max_chars + 4]).decode("utf-8", errors="replace")
        total = len(value)
        unit = "bytes"
    else:
        if value is None:
            text = ""
        elif isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError):
                text = str(value)
        total, unit = len(text), "characters"
        text = text.encode("utf-8", errors="replace").decode("utf-8")  # lone surrogates cannot be encoded later
    if len(text) <= max_chars and not (unit == "bytes" and total > 4 * max_chars + 4):
        return text, False
    note = f"\n[truncated: the result has {total} {unit}; showing the first {max_chars} characters]"
    return text[:max_chars] + note, True


class ToolRunner:
    """Runs tool calls with a time-out each, concurrently, turning every failure into text.

    Args:
        timeout_s: seconds a call may run; then its thread is abandoned and the model reads
            "timed out".
        max_result_chars: longer results are cut, with a note saying how long they were.
        max_stuck: abandoned (still running) calls tolerated; beyond it calls fail at once.
    """

    def __init__(self, timeout_s: float = 10.0, max_result_chars: int = 4096, max_stuck: int = 16):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"ToolRunner: timeout_s={timeout_s!r} must be a positive number of seconds")
        if not (isinstance(max_result_chars, int) and max_result_chars >= 1):
            raise ValueError(f"ToolRunner: max_result_chars={max_result_chars!r} must be an int >= 1")
        self.timeout_s = float(timeout_s)
        self.max_result_chars = max_result_chars
        self.max_stuck = max_stuck
        self._abandoned: list[threading.Thread] = []

    def stuck(self) -> int:
        """Abandoned calls still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def run(self, tool: Tool, arguments: Any) -> ToolOutcome:
        """One call (see `run_many`)."""
        return self.run_many([(tool, arguments)])[0]

    def run_many(self, calls: Sequence[tuple[Tool, Any]]) -> list[ToolOutcome]:
        """Runs the calls at once (one daemon thread each) and waits at most `timeout_s` for each.

        Args:
            calls: (tool, arguments) pairs; arguments should be a dict of keyword arguments.

        Returns:
            One ToolOutcome per call, in order; never raises for what a tool does.
        """
        outcomes: list[ToolOutcome | None] = [None] * len(calls)
        threads: list[tuple[int, threading.Thread, dict, float]] = []
        for index, (tool, arguments) in enumerate(calls):
            problem = self._argument_problem(tool, arguments)
            if problem is None and self.stuck() >= self.max_stuck:
                problem = (f"tool {tool.name} was not run: {self.max_stuck} earlier calls are still stuck "
                           "(threads cannot be killed); fix the hanging tool or give it a sandbox")
            if problem is not None:
                outcomes[index] = ToolOutcome(problem, ok=False, error=problem)
                continue
            slot: dict = {}
            thread = threading.Thread(target=self._call, args=(tool, dict(arguments), slot), daemon=True,
                                      name=f"rlbolt-tool-{tool.name}")
            thread.start()
            threads.append((index, thread, slot, time.monotonic()))
        for index, thread, slot, started in threads:
            tool = calls[index][0]
            thread.join(max(0.0, started + self.timeout_s - time.monotonic()))
            if thread.is_alive():
                self._abandoned.append(thread)
                message = f"tool {tool.name} timed out after {self.timeout_s:g} s"
                outcomes[index] = ToolOutcome(message, ok=False, error=message, seconds=self.timeout_s)
            else:
                outcomes[index] = self._outcome(tool, slot)
        return outcomes  # type: ignore[return-value]

    @staticmethod
    def _argument_problem(tool: Tool, arguments: Any) -> str | None:
        if not isinstance(arguments, Mapping):
            return f"tool {tool.name}: arguments must be a JSON object of parameter: value, got {arguments!r:.200}"
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as error:
            expected = list(tool.schema["function"]["parameters"]["properties"])
            return f"tool {tool.name}: bad arguments ({error}); its parameters are {expected}"
        except ValueError:  # builtins without a signature: let the call decide
            return None
        return None

    @staticmethod
    def _call(tool: Tool, arguments: dict, slot: dict) -> None:
        started = time.monotonic()
        try:
            slot["value"] = tool.fn(**arguments)
        except BaseException as error:  # noqa: BLE001 - a tool's SystemExit must not end the trainer
            slot["error"] = f"{type(error).__name__}: {error}"
        slot["seconds"] = time.monotonic() - started

    def _outcome(self, tool: Tool, slot: dict) -> ToolOutcome:
        seconds = slot.get("seconds", 0.0)
        if "error" in slot:
            message = f"tool {tool.name} failed: {slot['error']}"
            message, _ = result_text(message, self.max_result_chars)
            return ToolOutcome(message, ok=False, error=message, seconds=seconds)
        try:
            text, truncated = result_text(slot.get("value"), self.max_result_chars)
        except BaseException as error:  # noqa: BLE001 - e.g. an object whose __str__ raises
            message = f"tool {tool.name} returned a value that cannot be shown ({type(error).__name__}: {error})"
            return ToolOutcome(message, ok=False, error=message, seconds=seconds)
        return ToolOutcome(text, ok=True, seconds=seconds, truncated=truncated)


def python_tool(wall_s: float = 5.0, memory_bytes: int = 512 << 20, max_output_bytes: int = 16 * 1024) -> Tool:
    """A `python(code)` tool that runs the code in the sandbox and returns its output (and, when the
    program crashed, exited non-zero or hit a limit, the sandbox's one-line reason).

    Args:
        wall_s: wall-clock limit of one run (keep it below the ToolRunner's timeout_s).
        memory_bytes: address-space limit of the sandboxed child.
        max_output_bytes: how much of stdout/stderr the model sees.

    Returns:
        A Tool named "python".
    """
    from rlbolt.rewards.sandbox import run_python_sandboxed

    def python(code: str) -> str:
        """Runs a Python program in a sandbox and returns what it printed.

        Args:
            code: the program's source.
        """
        result = run_python_sandboxed(code, wall_s=wall_s, memory_bytes=memory_bytes,
                                      max_output_bytes=max_output_bytes)
        text = result.stdout + (("\n" + result.stderr) if result.stderr else "")
        return text if result.ok else f"{text}\n[the program did not finish cleanly: {result.reason}]".lstrip("\n")

    return as_tool(python)
