"""run_episodes: end reasons, batching, per-turn keys, failure isolation and metrics (scripted engine)."""

import threading

import jax
import numpy as np
import pytest
from agents_helpers import ChatTokenizer, ScriptedEngine

from rlbolt.agents import HermesToolParser, StepResult, ToolEnvironment, ToolRunner, run_episodes

KEYS = lambda n: np.arange(2 * n, dtype=np.uint32).reshape(n, 2)  # noqa: E731
TOK = ChatTokenizer()


class Counter:
    """Ends after `turns` steps (never when None); replies "ok"."""

    def __init__(self, turns=None, reply="ok"):
        self.turns, self.reply, self.steps = turns, reply, 0

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.steps += 1
        if self.turns is not None and self.steps >= self.turns:
            return StepResult(reward=1.0, done=True)
        return StepResult(messages=[{"role": "user", "content": self.reply}], reward=0.5)


def _run(envs, script=lambda h, k: "abc", **kw):
    engine = ScriptedEngine(TOK, script)
    limits = dict(max_turns=4, max_total_tokens=200, max_turn_tokens=16)
    limits.update(kw)
    return engine, run_episodes(engine, envs, KEYS(len(envs)), tokenizer=TOK, **limits)


def test_end_reasons_and_finished_episodes_leave_the_batch():
    envs = [Counter(turns=1), Counter(turns=2), Counter(), Counter(reply="x" * 300)]
    engine, out = _run(envs)
    assert list(out.end_reason) == ["done", "done", "max_turns", "budget"]
    assert list(out.turns) == [1, 2, 4, 1]
    assert engine.calls == [4, 2, 1, 1]  # each turn batches only the live episodes
    np.testing.assert_allclose(out.env_reward, [1.0, 1.5, 2.0, 0.5])
    # max_turns: the last reply is not appended (no turn follows it); each turn is "abc" + stop.
    assert out.completion_mask[2].sum() == 4 * 4
    assert out.sequence_mask[2].sum() == 4 * 4 + 3 * len(TOK.encode("\n<|im_start|>user\nok<|im_end|>\n"
                                                                    "<|im_start|>assistant\n"))
    # budget: the long reply filled the row; every row keeps the static width T.
    assert out.completion_ids.shape == (4, 200) and out.sequence_mask[3].all()
    assert out.completion_mask[3].sum() == 4


def test_the_token_budget_cuts_a_model_turn():
    _, out = _run([Counter()], script=lambda h, k: "abcdefgh", max_total_tokens=5)
    assert out.end_reason[0] == "budget" and out.completion_mask[0].sum() == 5 and out.sequence_mask[0].sum() == 5
    assert out.turns[0] == 1


def test_each_turn_is_sampled_with_fold_in_of_the_sample_key_and_the_turn():
    seen = {}

    def script(history, key):
        seen.setdefault(history.count("<|im_start|>assistant"), []).append(key)
        return "a"

    _run([Counter(), Counter()], script=script, max_turns=3)
    keys = KEYS(2)
    for turn in range(3):
        want = [tuple(int(x) for x in np.asarray(jax.random.fold_in(jax.numpy.asarray(k), turn))) for k in keys]
        assert seen[turn + 1] == want


def test_an_environment_that_raises_or_hangs_costs_only_its_episode():
    gate = threading.Event()

    class Raises(Counter):
        def step(self, text):
            raise KeyError("boom")

    class Hangs(Counter):
        def step(self, text):
            gate.wait(30)
            return StepResult(done=True)

    class WrongType(Counter):
        def step(self, text):
            return {"done": True}

    _, out = _run([Raises(), Hangs(), WrongType(), Counter(turns=2)], step_timeout_s=0.3)
    gate.set()
    assert list(out.end_reason) == ["env_error", "env_error", "env_error", "done"]
    assert "KeyError: 'boom'" in out.errors[0] and "step_timeout_s=0.3" in out.errors[1]
    assert "not a StepResult" in out.errors[2] and 3 not in out.errors
    assert out.env_reward[3] == 1.5


def lookup(key: str) -> str:
    """Looks a key up.

    Args:
        key: the key.
    """
    return {"a": "1"}[key]


def test_a_model_that_emits_malformed_calls_in_a_loop_costs_its_episode_and_shows_in_metrics():
    def script(history, key):
        if "go-bad" in history:
            return '<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>'
        if "tool_response" not in history:
            return '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
        return "1"

    def env(question):
        return ToolEnvironment([{"role": "user", "content": question}], [lookup], lambda a: float(a == "1"),
                               HermesToolParser())

    engine = ScriptedEngine(TOK, script)
    out = run_episodes(engine, [env("go-bad"), env("go")], KEYS(2), tokenizer=TOK, max_turns=5, max_total_tokens=3000,
                       max_turn_tokens=80)
    assert list(out.end_reason) == ["max_turns", "done"]
    assert list(out.tool_errors) == [5, 0] and list(out.tool_calls) == [0, 1]
    assert list(out.env_reward) == [0.0, 1.0]
    assert "malformed tool call (invalid JSON" in out.transcript[0]
    assert "<tool_response>1</tool_response>" in out.transcript[1]
    m = out.metrics()
    assert m["agents/tool_errors"] == 2.5 and m["agents/tool_calls"] == 0.5
    assert m["agents/end/max_turns"] == 0.5 and m["agents/end/done"] == 0.5 and m["agents/turns"] == 3.5
    model = out.completion_mask.sum(axis=1)
    env_tokens = out.sequence_mask.sum(axis=1) - model
    assert m["agents/model_tokens"] == model.mean() and m["agents/env_tokens"] == env_tokens.mean()


def test_tool_time_is_a_mean_over_episodes_like_every_other_metric():
    class Timed(Counter):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def step(self, text):
            return StepResult(done=True, tool_calls=2, tool_time_s=self.seconds)

    _, out = _run([Timed(0.25), Timed(0.5), Timed(0.0), Timed(1.25)])
    m = out.metrics()
    assert m["agents/tool_time_s"] == pytest.approx((0.25 + 0.5 + 0.0 + 1.25) / 4, rel=1e-7)  # dyadic times: float32 sums and /4 exact; 1e-7 < 1 ulp is slack
    assert m["agents/tool_calls"] == 2.0
    np.testing.assert_allclose(out.tool_time_s, [0.25, 0.5, 0.0, 1.25])


def test_hostile_tools_inside_episodes_become_messages_the_model_reads():
    gate = threading.Event()

    def fails(x: str) -> str:
        """Raises."""
        raise RuntimeError("tool broke")

    def hangs(x: str) -> str:
        """Hangs."""
        gate.wait(30)
        return ""

    def huge(x: str) -> str:
        """10 MB."""
        return "z" * (10 << 20)

    def binary(x: str) -> bytes:
        """Not UTF-8."""
        return b"\xff\xfe"

    calls = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{"x": "1"}}}}</tool_call>'
                    for n in ("fails", "hangs", "huge", "binary", "nope"))

    def script(history, key):
        return calls if "tool_response" not in history else "done"

    runner = ToolRunner(timeout_s=0.3, max_result_chars=50)
    env = ToolEnvironment([{"role": "user", "content": "q"}], [fails, hangs, huge, binary], lambda a: 1.0,
                          HermesToolParser(), runner=runner)
    _, out = _run([env], script=script, max_turn_tokens=400, max_total_tokens=2000)
    gate.set()
    assert out.end_reason[0] == "done" and out.tool_calls[0] == 5 and out.tool_errors[0] == 3
    text = out.transcript[0]
    assert "tool fails failed: RuntimeError: tool broke" in text
    assert "tool hangs timed out after 0.3 s" in text
    assert "z" * 50 + "\n[truncated: the result has 10485760 characters" in text
    assert "\ufffd\ufffd" in text and "unknown tool 'nope'" in text


def test_reset_none_uses_the_callers_prompt_and_bad_arguments_are_refused():
    class NoOpening(Counter):
        def reset(self):
            return None

    engine = ScriptedEngine(TOK, lambda h, k: "a")
    out = run_episodes(engine, [NoOpening(turns=1)], KEYS(1), tokenizer=TOK, prompt_ids=[[5, 6, 7]], max_turns=2,
                       max_total_tokens=10, max_turn_tokens=4)
    assert out.prompt_ids == [[5, 6, 7]]
    ids, mask = out.padded_prompts(TOK.pad_id, width=5)
    np.testing.assert_array_equal(ids, [[0, 0, 5, 6, 7]])
    np.testing.assert_array_equal(mask, [[False, False, True, True, True]])
    with pytest.raises(ValueError, match="width=2"):
        out.padded_prompts(TOK.pad_id, width=2)
    with pytest.raises(ValueError, match="pass prompt_ids or return messages"):
        run_episodes(engine, [NoOpening()], KEYS(1), tokenizer=TOK, max_turns=1, max_total_tokens=4, max_turn_tokens=2)
    with pytest.raises(ValueError, match=r"rng_keys must be \[N=2, 2\] uint32"):
        run_episodes(engine, [Counter(), Counter()], KEYS(1), tokenizer=TOK, max_turns=1, max_total_tokens=4,
                     max_turn_tokens=2)
    with pytest.raises(ValueError, match="max_turns=0 must be an int >= 1"):
        run_episodes(engine, [Counter()], KEYS(1), tokenizer=TOK, max_turns=0, max_total_tokens=4, max_turn_tokens=2)


def test_an_empty_batch_gives_empty_arrays():
    out = run_episodes(ScriptedEngine(TOK, lambda h, k: "a"), [], np.zeros((0, 2), np.uint32), tokenizer=TOK,
                       max_turns=2, max_total_tokens=8, max_turn_tokens=2)
    assert out.completion_ids.shape == (0, 8) and out.num_episodes == 0
    assert out.metrics()["agents/turns"] == 0.0


def test_a_final_turn_that_fills_the_budget_exactly_is_still_scored():
    # prompt, then "abc" + stop = 4 ids: exactly max_total_tokens
    _, out = _run([Counter(turns=1)], max_total_tokens=4)
    assert out.end_reason[0] == "done" and out.env_reward[0] == 1.0 and out.completion_mask[0].all()
    _, out = _run([Counter(turns=2)], max_total_tokens=4)  # room for no reply: cut by the budget
    assert out.end_reason[0] == "budget" and out.env_reward[0] == 0.5


def test_a_reset_that_raises_names_the_environment():
    class Broken(Counter):
        def reset(self):
            raise KeyError("question")

    with pytest.raises(RuntimeError, match=r"environment 1 \(Broken\).reset\(\) raised KeyError"):
        _run([Counter(), Broken()])
