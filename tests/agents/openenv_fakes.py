"""Stand-ins with the `openenv` package's interface (for the adapter's tests without the package).

The shapes follow openenv 0.10: an Environment has `reset(seed=None, episode_id=None, **kw)`,
`step(action, timeout_s=None, **kw)` returning an Observation with `done`, `reward`, `metadata`
and fields of its own; an MCP environment answers `ListToolsAction()` with
`ListToolsObservation(tools=[Tool(name, description, input_schema)])` and
`CallToolAction(tool_name, arguments)` with `CallToolObservation(tool_name, result, error)`,
the result an MCP `CallToolResult` (`content` text blocks, `data`, `is_error`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Observation:
    done: bool = False
    reward: float | None = None
    metadata: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TextObservation(Observation):
    text: str = ""


@dataclasses.dataclass
class CountAction:
    value: int

    def __post_init__(self):
        if not isinstance(self.value, int):
            raise ValueError(f"value: input should be a valid integer, got {self.value!r}")


@dataclasses.dataclass
class ListToolsAction:
    pass


@dataclasses.dataclass
class CallToolAction:
    tool_name: str
    arguments: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ToolListing:
    name: str
    description: str
    input_schema: dict


@dataclasses.dataclass
class ListToolsObservation(Observation):
    tools: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TextContent:
    text: str
    type: str = "text"


@dataclasses.dataclass
class CallToolResult:
    content: list
    data: Any = None
    is_error: bool = False


@dataclasses.dataclass
class ToolError:
    error_type: str
    message: str


@dataclasses.dataclass
class CallToolObservation(Observation):
    tool_name: str = ""
    result: Any = None
    error: ToolError | None = None


class CounterEnv:
    """Adds each action's value to a total; done (reward 1) when the total reaches `target`.

    Each step earns 0.1; the observation's text is "total=N". Records every step's timeout_s.
    """

    def __init__(self, target: int = 3):
        self.target, self.total = target, 0
        self.resets: list[dict] = []
        self.timeouts: list[Any] = []
        self.closed = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.resets.append({"seed": seed, "episode_id": episode_id, **kwargs})
        self.total = 0
        return TextObservation(text=f"reach {self.target}")

    def step(self, action, timeout_s=None, **kwargs):
        self.timeouts.append(timeout_s)
        self.total += action.value
        done = self.total >= self.target
        return TextObservation(text=f"total={self.total}", reward=1.0 if done else 0.1, done=done)

    def close(self):
        self.closed += 1


ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}


class CalculatorEnv:
    """An MCP environment: tools `add(a, b)` and `shout(text)` (10x its text); an answer action ends it.

    `finish` in a call's arguments makes the tool's observation done (reward 2).
    """

    def __init__(self, answer: str = "5"):
        self.answer = answer
        self.calls: list[CallToolAction] = []
        self.closed = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        return TextObservation(text="")

    def step(self, action, timeout_s=None, **kwargs):
        if isinstance(action, ListToolsAction):
            return ListToolsObservation(tools=[
                ToolListing("add", "Adds two integers.", ADD_SCHEMA),
                ToolListing("shout", "Repeats a text.", {"type": "object", "properties": {"text": {"type": "string"}}})])
        if isinstance(action, CallToolAction):
            self.calls.append(action)
            if action.tool_name == "add":
                a, b = action.arguments.get("a"), action.arguments.get("b")
                if not (isinstance(a, int) and isinstance(b, int)):
                    return CallToolObservation(tool_name="add", error=ToolError("invalid_args", "a and b: integers"))
                done = bool(action.arguments.get("finish"))
                return CallToolObservation(tool_name="add", result=CallToolResult([TextContent(str(a + b))], a + b),
                                           reward=2.0 if done else None, done=done)
            if action.tool_name == "shout":
                return CallToolObservation(tool_name="shout", result={"content": [{"type": "text",
                                                                                    "text": action.arguments["text"] * 10}]})
            return CallToolObservation(tool_name=action.tool_name,
                                       error=ToolError("tool_not_found", f"Tool '{action.tool_name}' not found"))
        return TextObservation(text="", reward=float(action.strip() == self.answer), done=True)

    def close(self):
        self.closed += 1
