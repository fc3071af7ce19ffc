"""OpenEnvEnvironment's mapping logic, without the openenv package (stand-ins with its interface).

The same adapter runs against the real package in test_openenv_package.py (marker `openenv`).
"""

import dataclasses
import gc
import threading

import numpy as np
import pytest
from agents_helpers import ChatTokenizer, ScriptedEngine
from openenv_fakes import (CalculatorEnv, CallToolAction, CallToolObservation, CallToolResult, CountAction,
                           CounterEnv, ListToolsAction, TextContent, TextObservation, ToolError)

from rlbolt.agents import StepResult, run_episodes
from rlbolt.agents.openenv_adapter import OpenEnvEnvironment, observation_text, tool_result_text

TOK = ChatTokenizer()
MCP = (ListToolsAction, CallToolAction)
KEYS = lambda n: np.arange(2 * n, dtype=np.uint32).reshape(n, 2)  # noqa: E731


def _count(text):
    return CountAction(int(text))  # int("x") raises: the model's malformed turn


def _episodes(envs, script, **limits):
    engine = ScriptedEngine(TOK, script)
    kw = dict(max_turns=4, max_total_tokens=600, max_turn_tokens=120)
    kw.update(limits)
    return run_episodes(engine, envs, KEYS(len(envs)), tokenizer=TOK, **kw)


def test_observation_text_keeps_one_string_field_and_writes_json_otherwise():
    @dataclasses.dataclass
    class Board:
        done: bool = False
        reward: float | None = None
        metadata: dict = dataclasses.field(default_factory=dict)
        board: list = dataclasses.field(default_factory=lambda: [[1, 0], [0, 2]])
        legal: tuple = ("a1", "b2")

    assert observation_text(TextObservation(text="héllo", reward=1.0, done=True, metadata={"k": 1})) == "héllo"
    assert observation_text(Board()) == '{"board": [[1, 0], [0, 2]], "legal": ["a1", "b2"]}'
    assert observation_text(None) == "" and observation_text("plain") == "plain"
    assert observation_text({"echoed": "hi", "reward": 1.0, "done": False}) == "hi"  # a generic client's dict

    @dataclasses.dataclass
    class Nested:
        cell: TextObservation
        grid: np.ndarray

    nested = Nested(TextObservation(text="x"), np.arange(4).reshape(2, 2))
    assert observation_text(nested) == ('{"cell": {"done": false, "reward": null, "metadata": {}, "text": "x"}, '
                                        '"grid": [[0, 1], [2, 3]]}')

    class Plain:  # neither pydantic nor a dataclass: its instance attributes
        def __init__(self):
            self.done, self.score, self.when = False, 3, object()

    text = observation_text(Plain())
    assert text.startswith('{"score": 3, "when": "<object object at') and "done" not in text


def test_tool_result_text_reads_errors_content_blocks_dicts_and_data():
    ok = CallToolObservation(tool_name="f", result=CallToolResult([TextContent("a"), TextContent("b")], data=9))
    assert tool_result_text(ok) == ("a\nb", True)
    over_http = {"tool_name": "f", "result": {"content": [{"type": "text", "text": "7"}], "isError": False}}
    assert tool_result_text(over_http) == ("7", True)
    failed = CallToolObservation(tool_name="f", result=CallToolResult([TextContent("bad input")], is_error=True))
    assert tool_result_text(failed) == ("tool f failed: bad input", False)
    framework = CallToolObservation(tool_name="f", error=ToolError("timeout", "Tool 'f' timed out after 1 seconds"))
    assert tool_result_text(framework) == ("tool f failed (timeout): Tool 'f' timed out after 1 seconds", False)
    no_text_blocks = CallToolObservation(tool_name="f", result=CallToolResult([{"type": "image"}], data={"x": [1]}))
    assert tool_result_text(no_text_blocks) == ('{"x": [1]}', True)
    assert tool_result_text(CallToolObservation(tool_name="f", result=b"\xff ok")) == ("\ufffd ok", True)
    assert tool_result_text(CallToolObservation(tool_name="f", result=None)) == ("", True)


def test_a_counter_environment_runs_through_run_episodes_with_rewards_and_done():
    def script(history, key):
        return "2" if history.count("total=") == 0 else "1"

    envs = [CounterEnv(target=3), CounterEnv(target=100)]
    wrapped = [OpenEnvEnvironment(e, action=_count, reset_kwargs={"seed": i, "episode_id": f"ep{i}"},
                                  action_timeout_s=5.0) for i, e in enumerate(envs)]
    out = _episodes(wrapped, script)
    assert list(out.end_reason) == ["done", "max_turns"] and list(out.turns) == [2, 4]
    np.testing.assert_allclose(out.env_reward, [0.1 + 1.0, 0.4], rtol=1e-6)  # 0.1 a step, 1 on reaching 3
    assert envs[0].resets == [{"seed": 0, "episode_id": "ep0"}] and envs[1].resets[0]["seed"] == 1
    assert envs[0].timeouts == [5.0, 5.0]  # action_timeout_s reaches env.step(..., timeout_s=)
    assert envs[0].closed == 1 and envs[1].closed == 0  # closed when its episode is done
    # The reset observation opens the conversation; each observation's text is the next user turn.
    assert out.transcript[0] == ("<|im_start|>user\nreach 3<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
                                 "<|im_start|>user\ntotal=2<|im_end|>\n<|im_start|>assistant\n1<|im_end|>")
    assert [m["content"] for m in out.messages[1]] == ["reach 100", "2", "total=2", "1", "total=3", "1", "total=4",
                                                       "1", "total=5"]
    # Token rules: the model's ids (each turn plus its stop token) are the only ones trained.
    assert out.completion_mask[0].sum() == 4 and out.completion_mask[1].sum() == 8


def test_a_turn_the_action_parser_refuses_is_answered_and_counted_the_episode_goes_on():
    env = CounterEnv(target=2)
    out = _episodes([OpenEnvEnvironment(env, action=_count)], lambda h, k: "x" if "invalid" not in h else "2")
    assert out.end_reason[0] == "done" and out.turns[0] == 2 and out.tool_errors[0] == 1
    assert "invalid action (ValueError): invalid literal for int() with base 10: 'x'" in out.transcript[0]
    assert env.timeouts == [None]  # only the valid turn reached the environment; no timeout_s unless asked


def test_mcp_tools_are_listed_rendered_called_and_answered():
    env = CalculatorEnv(answer="5")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    def script(history, key):
        return call if "tool_response" not in history else "5"

    tok = ChatTokenizer()
    wrapped = OpenEnvEnvironment(env, action=str, mcp_actions=MCP, mcp=True,
                                 opening=[{"role": "user", "content": "2+3?"}])
    assert [t.name for t in wrapped.tools] == ["add", "shout"]
    assert wrapped.tools[0].schema == {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}}
    out = run_episodes(ScriptedEngine(tok, script), [wrapped], KEYS(1), tokenizer=tok, max_turns=3,
                       max_total_tokens=400, max_turn_tokens=80)
    assert out.end_reason[0] == "done" and out.env_reward[0] == 1.0
    assert out.tool_calls[0] == 1 and out.tool_errors[0] == 0 and out.tool_time_s[0] >= 0
    assert env.calls == [CallToolAction("add", {"a": 2, "b": 3})]
    assert "<tool_response>5</tool_response>" in out.transcript[0]
    assert tok.template_calls[0]["tools"] == [t.schema for t in wrapped.tools]  # the prompt lists the tools


def test_mcp_errors_unknown_tools_too_many_calls_and_long_results_are_messages():
    env = CalculatorEnv()
    calls = ('<tool_call>{"name": "add", "arguments": {"a": "x", "b": 1}}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "shout", "arguments": {"text": "abcdef"}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": </tool_call>')
    wrapped = OpenEnvEnvironment(env, mcp=True, mcp_actions=MCP, max_calls_per_turn=3, max_text_chars=12)
    wrapped.reset()
    result = wrapped.step(calls)
    assert isinstance(result, StepResult) and not result.done
    assert result.tool_calls == 4 and result.tool_errors == 4  # the bad JSON, bad args, unknown, over the limit
    texts = [m["content"] for m in result.messages]
    assert [t[:12] for t in texts] == ["malformed to", "tool add fai", "unknown tool", "abcdefabcdef", "too many too"]
    assert all("[truncated: the result has" in t for t in texts)  # every text is cut at max_text_chars
    assert texts[3] == "abcdefabcdef\n[truncated: the result has 60 characters; showing the first 12 characters]"
    assert [c.tool_name for c in env.calls] == ["add", "shout"]  # the unknown and the 4th call never reached it
    assert [m["role"] for m in result.messages] == ["tool"] * 5


def test_a_tool_observation_that_is_done_ends_the_episode_and_a_turn_without_calls_is_the_answer():
    env = CalculatorEnv()
    wrapped = OpenEnvEnvironment(env, mcp=True, mcp_actions=MCP)
    result = wrapped.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "finish": 1}}</tool_call>'
                          '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    assert result.done and result.reward == 2.0 and len(env.calls) == 1 and env.closed == 1
    no_action = OpenEnvEnvironment(CalculatorEnv(), mcp=True, mcp_actions=MCP)
    assert no_action.step("the answer is 3") == StepResult(done=True)  # no action parser: a final answer


def test_a_client_step_result_is_unpacked():
    @dataclasses.dataclass
    class ClientResult:  # what SyncEnvClient.step returns
        observation: object
        reward: float | None = None
        done: bool = False

    class Client(CounterEnv):
        def reset(self, **kwargs):
            return ClientResult(super().reset(**kwargs))

        def step(self, action, **kwargs):
            obs = super().step(action, **kwargs)
            return ClientResult(obs, obs.reward, obs.done)

    wrapped = OpenEnvEnvironment(Client(target=1), action=_count)
    assert wrapped.reset() == [{"role": "user", "content": "reach 1"}]
    assert wrapped.step("1") == StepResult(messages=[{"role": "user", "content": "total=1"}], reward=1.0, done=True)


def test_opening_as_a_function_of_the_reset_text():
    wrapped = OpenEnvEnvironment(CounterEnv(target=4), action=_count,
                                 opening=lambda text: [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": text.upper()}])
    assert wrapped.reset() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "REACH 4"}]


def test_hostile_openenv_environments_cost_only_their_episode():
    gate = threading.Event()

    class Raises(CounterEnv):
        def step(self, action, timeout_s=None, **kwargs):
            raise RuntimeError("env crashed")

    class Hangs(CounterEnv):
        def step(self, action, timeout_s=None, **kwargs):
            gate.wait(30)
            return TextObservation(done=True)

    class Huge(CounterEnv):
        def step(self, action, timeout_s=None, **kwargs):
            return TextObservation(text="\ud800" + "y" * (10 << 20), reward=None)

    envs = [OpenEnvEnvironment(e, action=_count, max_text_chars=20) for e in (Raises(), Hangs(), Huge(),
                                                                              CounterEnv(target=1))]
    out = _episodes(envs, lambda h, k: "1", max_turns=2, max_total_tokens=400, step_timeout_s=3.0)
    gate.set()
    assert list(out.end_reason) == ["env_error", "env_error", "max_turns", "done"]
    assert "RuntimeError: env crashed" in out.errors[0] and "step_timeout_s=3" in out.errors[1]
    assert out.env_reward[2] == 0.0 and out.env_reward[3] == 1.0
    # 10 MB with a lone surrogate becomes 20 valid characters and a note (the character tokenizer maps
    # the replacement character to its unknown id).
    assert "?" + "y" * 19 + "\n[truncated: the result has 10485761 characters" in out.transcript[2].replace(
        "\ufffd", "?")


def test_a_hanging_reset_is_a_timeout_naming_the_environment_not_a_stuck_rollout():
    gate = threading.Event()

    class Stuck(CounterEnv):
        def reset(self, **kwargs):
            gate.wait(30)

    with pytest.raises(RuntimeError, match=r"Stuck\.reset did not return within 0\.2 s"):
        _episodes([OpenEnvEnvironment(CounterEnv(), action=_count),
                   OpenEnvEnvironment(Stuck(), action=_count, reset_timeout_s=0.2)], lambda h, k: "1")
    gate.set()


def test_bad_arguments_and_a_failed_tool_listing_are_one_line_errors():
    with pytest.raises(ValueError, match="max_calls_per_turn=0 must be an int >= 1"):
        OpenEnvEnvironment(CounterEnv(), max_calls_per_turn=0)
    with pytest.raises(ValueError, match="action_timeout_s=-1 must be a positive number"):
        OpenEnvEnvironment(CounterEnv(), action_timeout_s=-1)

    class BrokenListing(CalculatorEnv):
        def step(self, action, timeout_s=None, **kwargs):
            from openenv_fakes import ListToolsObservation
            return ListToolsObservation(tools=[], metadata={"error": "server down"})

    with pytest.raises(ValueError, match=r"listing the MCP tools of BrokenListing failed \(server down\); pass "
                                         "mcp=False"):
        OpenEnvEnvironment(BrokenListing(), mcp=True, mcp_actions=MCP)


def test_the_wrapped_environment_is_closed_once_when_the_wrapper_goes_away():
    env = CounterEnv(target=1)
    wrapped = OpenEnvEnvironment(env, action=_count)
    wrapped.step("1")  # done: closed
    wrapped.close()
    del wrapped
    gc.collect()
    assert env.closed == 1
    other = CounterEnv()
    OpenEnvEnvironment(other, action=_count)  # never done: closed when collected
    gc.collect()
    assert other.closed == 1


def test_without_the_package_mcp_needs_the_action_classes(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_openenv(name, *args, **kwargs):
        if name.startswith("openenv"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_openenv)
    assert OpenEnvEnvironment(CalculatorEnv(), action=str).mcp is False  # auto: not an MCPEnvironment
    with pytest.raises(ImportError, match=r"pip install 'rlbolt\[openenv\]', or pass mcp_actions="):
        OpenEnvEnvironment(CalculatorEnv(), mcp=True)
