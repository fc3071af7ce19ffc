"""OpenEnvEnvironment against the real openenv package: local OpenEnv environments written here.

Marker `openenv` (skipped by the default run; the package is the `rlbolt[openenv]` extra, too heavy
for the default install): `python -m pytest -m openenv tests/agents/test_openenv_package.py`.
"""

import asyncio
import threading

import numpy as np
import pytest
from agents_helpers import ChatTokenizer, ScriptedEngine

pytestmark = pytest.mark.openenv
pytest.importorskip("openenv.core.env_server.mcp_environment", reason="needs the openenv package (rlbolt[openenv])")

from fastmcp import FastMCP  # noqa: E402  (installed with openenv)
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from rlbolt.agents import run_episodes  # noqa: E402
from rlbolt.agents.openenv_adapter import OpenEnvEnvironment  # noqa: E402

TOK = ChatTokenizer()
KEYS = lambda n: np.arange(2 * n, dtype=np.uint32).reshape(n, 2)  # noqa: E731


class Add(Action):
    value: int


class Total(Observation):
    total: int = 0
    goal: str = ""


class CounterEnv(Environment):
    """Adds each action's value; done with reward 1 when the total reaches the target (0.1 a step before)."""

    def __init__(self, target: int):
        super().__init__()
        self.target, self.total = target, 0
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.total = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return Total(total=0, goal=f"reach {self.target}")

    def step(self, action, timeout_s=None, **kwargs):
        self.total += action.value
        self._state.step_count += 1
        done = self.total >= self.target
        return Total(total=self.total, reward=1.0 if done else 0.1, done=done)

    @property
    def state(self):
        return self._state


class Answer(Action):
    answer: str


class Reply(Observation):
    text: str = ""


class Calculator(MCPEnvironment):
    """MCP tools add / fails / sleeps; an Answer action ends the episode, reward 1 when it is `answer`."""

    def __init__(self, answer: str):
        server = FastMCP("calculator")

        @server.tool()
        def add(a: int, b: int) -> int:
            """Adds two integers."""
            return a + b

        @server.tool()
        def fails(x: str) -> str:
            """Always raises."""
            raise ValueError(f"cannot {x}")

        @server.tool()
        async def sleeps(x: str) -> str:
            """Sleeps longer than any call may take."""
            await asyncio.sleep(20)
            return x

        super().__init__(server)
        self.answer = answer
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Reply(text="What is 2 + 3?")

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Reply(done=True, reward=float(action.answer.strip() == self.answer))

    @property
    def state(self):
        return self._state


def _turn_as_add(text):
    return Add(value=int(text))


def test_an_openenv_environment_runs_through_run_episodes():
    envs = [OpenEnvEnvironment(CounterEnv(3), action=_turn_as_add, reset_kwargs={"episode_id": "a"}),
            OpenEnvEnvironment(CounterEnv(50), action=_turn_as_add)]
    out = run_episodes(ScriptedEngine(TOK, lambda h, k: "2"), envs, KEYS(2), tokenizer=TOK, max_turns=3,
                       max_total_tokens=400, max_turn_tokens=8)
    assert list(out.end_reason) == ["done", "max_turns"] and list(out.turns) == [2, 3]
    np.testing.assert_allclose(out.env_reward, [1.1, 0.3], rtol=1e-6)
    assert out.messages[0][0] == {"role": "user", "content": '{"total": 0, "goal": "reach 3"}'}
    assert '<|im_start|>user\n{"total": 2, "goal": ""}<|im_end|>' in out.transcript[0]
    assert envs[0].env.state.episode_id == "a" and envs[0].env.state.step_count == 2


def test_a_turn_pydantic_refuses_is_answered_not_raised():
    env = OpenEnvEnvironment(CounterEnv(1), action=lambda text: Add(value=text))  # "x" is not an int
    env.reset()
    result = env.step("x")
    assert not result.done and result.tool_errors == 1
    assert result.messages[0]["content"].startswith("invalid action (ValidationError): 1 validation error for Add")


def test_mcp_tool_actions_of_an_mcp_environment():
    tok = ChatTokenizer()
    good = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    hostile = ('<tool_call>{"name": "fails", "arguments": {"x": "this"}}</tool_call>'
               '<tool_call>{"name": "sleeps", "arguments": {"x": "z"}}</tool_call>'
               '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>' + good)

    def script(history, key):
        if history.count("tool_response") == 0:
            return hostile if "hostile" in history else good
        return "5"

    def make(kind):
        return OpenEnvEnvironment(Calculator("5"), action=lambda text: Answer(answer=text), action_timeout_s=3.0,
                                  opening=[{"role": "user", "content": f"{kind}: what is 2 + 3?"}])

    envs = [make("plain"), make("hostile")]
    assert envs[0].mcp and [t.name for t in envs[0].tools] == ["add", "fails", "sleeps"]
    assert envs[0].tools[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    out = run_episodes(ScriptedEngine(tok, script), envs, KEYS(2), tokenizer=tok, max_turns=3, max_total_tokens=2000,
                       max_turn_tokens=400, step_timeout_s=30)
    assert list(out.end_reason) == ["done", "done"] and list(out.env_reward) == [1.0, 1.0]
    assert list(out.tool_calls) == [1, 4] and list(out.tool_errors) == [0, 3]
    assert "<tool_response>5</tool_response>" in out.transcript[0]
    hostile_text = out.transcript[1]
    assert "tool fails failed (execution_error)" in hostile_text and "cannot this" in hostile_text
    assert "tool sleeps failed (timeout)" in hostile_text
    assert "tool add failed" in hostile_text and hostile_text.count("<tool_response>5</tool_response>") == 1
    assert [t["function"]["name"] for t in tok.template_calls[0]["tools"]] == ["add", "fails", "sleeps"]
    assert out.tool_time_s[1] >= 3.0  # the sleeping call ran until its time-out


def test_an_openenv_environment_that_raises_or_hangs_costs_only_its_episode():
    gate = threading.Event()

    class Raises(CounterEnv):
        def step(self, action, timeout_s=None, **kwargs):
            raise RuntimeError("simulator crashed")

    class Hangs(CounterEnv):
        def step(self, action, timeout_s=None, **kwargs):
            gate.wait(30)
            return Total(done=True)

    envs = [OpenEnvEnvironment(e, action=_turn_as_add) for e in (Raises(5), Hangs(5), CounterEnv(2))]
    out = run_episodes(ScriptedEngine(TOK, lambda h, k: "1"), envs, KEYS(3), tokenizer=TOK, max_turns=3,
                       max_total_tokens=400, max_turn_tokens=8, step_timeout_s=3.0)
    gate.set()
    assert list(out.end_reason) == ["env_error", "env_error", "done"]
    assert "RuntimeError: simulator crashed" in out.errors[0] and "step_timeout_s=3" in out.errors[1]
    np.testing.assert_allclose(out.env_reward, [0.0, 0.0, 1.1], rtol=1e-6)


def test_observation_text_of_pydantic_observations():
    from pydantic import BaseModel

    from rlbolt.agents.openenv_adapter import observation_text

    class Cell(BaseModel):
        row: int
        col: int

    class Board(Observation):
        cells: list[Cell] = []
        turn: str = ""

    board = Board(cells=[Cell(row=1, col=2)], turn="x", reward=1.0, done=True, metadata={"k": 1})
    assert observation_text(board) == '{"cells": [{"row": 1, "col": 2}], "turn": "x"}'
    assert observation_text(Reply(text="only this", reward=0.5)) == "only this"


def test_sync_clients_of_a_local_openenv_server_on_loopback():
    """Each episode's own client session (GenericEnvClient(...).sync()) to a server on 127.0.0.1."""
    import socket
    import time

    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.generic_client import GenericEnvClient

    class Sessions(CounterEnv):
        SUPPORTS_CONCURRENT_SESSIONS = True

    app = create_fastapi_app(lambda: Sessions(3), Add, Total, max_concurrent_envs=4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        envs = [OpenEnvEnvironment(GenericEnvClient(base_url=url).sync(), action=lambda text: {"value": int(text)})
                for _ in range(2)]
        out = run_episodes(ScriptedEngine(TOK, lambda h, k: "1"), envs, KEYS(2), tokenizer=TOK, max_turns=4,
                           max_total_tokens=400, max_turn_tokens=8, step_timeout_s=30)
    finally:
        server.should_exit = True
        thread.join(10)
    # Separate sessions: each total reaches 3 after its own three turns (a shared one would after two).
    assert list(out.end_reason) == ["done", "done"] and list(out.turns) == [3, 3] and not out.errors
    np.testing.assert_allclose(out.env_reward, [1.2, 1.2], rtol=1e-6)
    assert out.messages[0][0]["content"] == '{"total": 0, "goal": "reach 3"}'  # the dict observation's fields
