"""Token-in/token-out: the trained ids are the sampled ids plus the environment's delta ids, never a
re-tokenisation of the conversation (checked with a template that is not append-only)."""

import numpy as np
import pytest
from agents_helpers import ChatTokenizer, ScriptedEngine

from rlbolt.agents import StepResult, TurnRenderer, run_episodes
from rlbolt.data.tokenizers import CharTokenizer

KEYS = lambda n: np.arange(2 * n, dtype=np.uint32).reshape(n, 2)  # noqa: E731


class Echo:
    """Replies "got <turn>" twice, then ends with reward 1."""

    def __init__(self):
        self.seen = []

    def reset(self):
        return [{"role": "user", "content": "hi"}]

    def step(self, text):
        self.seen.append(text)
        if len(self.seen) == 3:
            return StepResult(reward=1.0, done=True)
        return StepResult(messages=[{"role": "tool", "content": f"got {len(self.seen)}"}], reward=0.25)


TURNS = ["<think>plan A</think>call 1", "<think>plan B</think>call 2", "<think>done</think>answer"]


def _script(history, key):
    return TURNS[history.count("<|im_start|>assistant\n") - 1]


def test_trained_ids_are_the_sampled_ids_turn_by_turn_with_a_non_append_only_template():
    tok = ChatTokenizer()
    env = Echo()
    out = run_episodes(ScriptedEngine(tok, _script), [env], KEYS(1), tokenizer=tok, max_turns=5,
                       max_total_tokens=200, max_turn_tokens=40)
    # Hand-built expectation: sampled turn (+ its stop id), then the delta the template writes after
    # an assistant turn's close: the stop text is already sampled, so the delta starts at "\n".
    expected, mask = [], []
    for k, turn in enumerate(TURNS):
        sampled = tok.encode(turn) + [tok.eos_id]
        expected += sampled
        mask += [True] * len(sampled)
        if k < 2:
            env_ids = tok.encode(f"\n<|im_start|>user\n<tool_response>got {k + 1}</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n")
            expected += env_ids
            mask += [False] * len(env_ids)
    n = len(expected)
    np.testing.assert_array_equal(out.completion_ids[0, :n], expected)
    np.testing.assert_array_equal(out.completion_mask[0, :n], mask)
    assert not out.completion_mask[0, n:].any() and not out.sequence_mask[0, n:].any()
    assert out.sequence_mask[0, :n].all()
    assert (out.completion_ids[0, n:] == tok.pad_id).all()
    assert out.prompt_ids[0] == tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # The environment read each turn's answer (the reasoning split off, no stop token); the
    # messages hold the answer as content and the reasoning beside it; the ids above hold both.
    assert env.seen == ["call 1", "call 2", "answer"]
    assert [m for m in out.messages[0] if m["role"] == "assistant"] == [
        {"role": "assistant", "content": "call 1", "reasoning_content": "plan A"},
        {"role": "assistant", "content": "call 2", "reasoning_content": "plan B"},
        {"role": "assistant", "content": "answer", "reasoning_content": "done"}]
    assert out.env_reward[0] == pytest.approx(1.5)
    assert out.end_reason[0] == "done" and out.turns[0] == 3
    # Re-rendering the whole conversation drops the earlier reasoning: a re-tokenisation would train
    # on ids the model never sampled. The episode's ids keep it.
    rerendered = tok.encode(tok.apply_chat_template(out.messages[0], add_generation_prompt=False))
    assert rerendered != out.prompt_ids[0] + expected
    assert "plan A" in out.transcript[0] and "plan A" not in tok.decode(rerendered)


def test_without_reasoning_tags_the_environment_reads_the_whole_turn_and_the_ids_are_the_same():
    tok = ChatTokenizer()
    split, raw = Echo(), Echo()
    a = run_episodes(ScriptedEngine(tok, _script), [split], KEYS(1), tokenizer=tok, max_turns=5,
                     max_total_tokens=200, max_turn_tokens=40)
    b = run_episodes(ScriptedEngine(tok, _script), [raw], KEYS(1), tokenizer=tok, max_turns=5,
                     max_total_tokens=200, max_turn_tokens=40, reasoning_tags=None)
    assert raw.seen == TURNS and split.seen == ["call 1", "call 2", "answer"]
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    assert a.transcript[0] == b.transcript[0] and "<think>plan A</think>call 1" in a.transcript[0]


def test_logps_sit_on_the_sampled_ids_and_are_zero_on_environment_ids():
    tok = ChatTokenizer()
    out = run_episodes(ScriptedEngine(tok, _script), [Echo()], KEYS(1), tokenizer=tok, max_turns=5,
                       max_total_tokens=200, max_turn_tokens=40)
    mask, logps = out.completion_mask[0], out.sampler_logps[0]
    assert (logps[~mask] == 0).all()
    # Each turn's logps restart at -0.01 (the scripted engine's per-turn positions).
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    assert len(starts) == 3
    np.testing.assert_allclose(logps[starts], -0.01)
    assert (logps[mask] < 0).all()


def test_a_turn_cut_at_max_turn_tokens_gets_the_whole_close_of_the_turn():
    tok = ChatTokenizer()
    renderer = TurnRenderer(tok)
    reply = [{"role": "user", "content": "x"}]
    stopped = renderer.delta_text(reply, turn_stopped=True)
    cut = renderer.delta_text(reply, turn_stopped=False)
    assert stopped == "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert cut == "<|im_end|>" + stopped


def test_tools_reach_templates_that_take_them_and_not_the_tiny_tokenizers():
    tok = ChatTokenizer()
    schema = {"type": "function", "function": {"name": "f", "description": "", "parameters": {}}}
    TurnRenderer(tok, tools=[schema]).prompt_ids([{"role": "user", "content": "q"}])
    assert tok.template_calls[-1]["tools"] == [schema]
    char = CharTokenizer("abc\n")
    assert TurnRenderer(char, tools=[schema]).prompt_ids([{"role": "user", "content": "ab"}]) == char.encode("ab\n")


def test_a_template_that_does_not_render_content_verbatim_is_refused_in_one_line():
    tok = ChatTokenizer(template="{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(ValueError, match="does not render an assistant message's content verbatim") as error:
        TurnRenderer(tok).delta_text([{"role": "user", "content": "x"}], True)
    assert "\n" not in str(error.value)


def test_chat_template_options_reach_every_render_from_the_config():
    from rlbolt.config import load_config
    from rlbolt.modules.prompts import PromptEncoder

    cfg = load_config({"data": {"chat_template_kwargs": {"enable_thinking": False}}})
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    tok = ChatTokenizer()
    tok.chat_template = tok.template
    PromptEncoder(tok, template_kwargs=cfg.data.chat_template_kwargs).encode({"question": "q"})
    TurnRenderer(tok, template_kwargs=cfg.data.chat_template_kwargs).delta_ids([{"role": "user", "content": "x"}], True)
    assert tok.template_calls == [{"enable_thinking": False}] * 2
    char = CharTokenizer("abc\n")  # its plain join takes no template variables: left out, not a TypeError
    assert TurnRenderer(char, template_kwargs={"enable_thinking": False}).prompt_ids(
        [{"role": "user", "content": "ab"}]) == char.encode("ab\n")
