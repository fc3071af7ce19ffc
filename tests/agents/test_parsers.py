"""Tool-call parsers for the Qwen (Hermes) and Llama 3 formats and the compact demo format."""

import pytest

from rlbolt.agents import CompactToolParser, HermesToolParser, Llama3JsonToolParser, ToolCall


def test_hermes_reads_every_call_and_keeps_the_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == (ToolCall("get_weather", {"city": "Oslo", "days": 2}), ToolCall("now", {}))
    assert parsed.errors == () and parsed.content == "Let me check."


def test_hermes_arguments_given_as_a_json_string_are_accepted():
    parsed = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parsed.calls == (ToolCall("f", {"x": 1}),)


@pytest.mark.parametrize("body, message", [
    ('{"name": "f", "arguments": {"x": 1}', "invalid JSON"),
    ('["f"]', "expected a JSON object"),
    ('{"arguments": {}}', '"name" must be a non-empty string'),
    ('{"name": "f", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "f", "arguments": "not json"}', "is a string that is not a JSON object"),
])
def test_hermes_malformed_calls_become_messages(body, message):
    parsed = HermesToolParser().parse(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == () and len(parsed.errors) == 1 and message in parsed.errors[0]


def test_hermes_unclosed_call_is_an_error_and_plain_text_is_content():
    parsed = HermesToolParser().parse('answer <tool_call>{"name": "f"')
    assert parsed.calls == () and "without </tool_call>" in parsed.errors[0] and parsed.content == "answer"
    assert HermesToolParser().parse("  42  ").content == "42"


def test_llama3_json_calls():
    parser = Llama3JsonToolParser()
    one = parser.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert one.calls == (ToolCall("get_weather", {"city": "Oslo"}),) and one.errors == ()
    two = parser.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 1}}')
    assert two.calls == (ToolCall("a", {}), ToolCall("b", {"k": 1}))
    assert parser.parse("The answer is 4.").content == "The answer is 4." and parser.parse("x").calls == ()
    bad = parser.parse('{"name": "a", "parameters": {')
    assert bad.calls == () and "invalid JSON" in bad.errors[0]
    half = parser.parse('{"name": "a", "parameters": {}}; {"name": 3}')
    assert half.calls == (ToolCall("a", {}),) and '"name" must be' in half.errors[0]


def test_compact_parser():
    parser = CompactToolParser({"?": ("lookup", "key")})
    assert parser.parse("?3").calls == (ToolCall("lookup", {"key": "3"}),)
    assert parser.parse("7").content == "7" and parser.parse("7").calls == ()
    assert "needs a key" in parser.parse("?").errors[0]
    with pytest.raises(ValueError, match="must be one character"):
        CompactToolParser({"??": ("a", "b")})


THOUGHT_CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'


@pytest.mark.parametrize("parser, thought_call", [
    (HermesToolParser(), THOUGHT_CALL),
    (Llama3JsonToolParser(), '{"name": "lookup", "parameters": {"key": "a"}}'),
    (CompactToolParser({"?": ("lookup", "key")}), "?a"),
])
def test_a_call_written_while_thinking_is_not_a_call_and_the_answer_is_the_content(parser, thought_call):
    # Hostile: the reasoning holds a well-formed call (and for Llama 3 starts with it).
    parsed = parser.parse(f"<think>{thought_call}? no.</think>\n\n42")
    assert parsed.calls == () and parsed.errors == ()
    assert parsed.content == "42" and parsed.reasoning == f"{thought_call}? no."
    # Cut off while thinking: all reasoning, no answer, no call.
    parsed = parser.parse(f"<think>{thought_call}")
    assert parsed.calls == () and parsed.content == "" and parsed.reasoning == thought_call
    # A call in the answer after the reasoning still runs; reasoning_tags=None reads the whole turn.
    parsed = parser.parse(f"<think>I will look it up.</think>{thought_call}")
    assert [c.name for c in parsed.calls] == ["lookup"] and parsed.reasoning == "I will look it up."
    raw = type(parser)(*([parser.calls] if isinstance(parser, CompactToolParser) else []), reasoning_tags=None)
    assert raw.parse(f"{thought_call}</think>").reasoning == ""


def test_split_reasoning():
    from rlbolt.agents import split_reasoning

    assert split_reasoning("<think>\nplan\n</think>\n\nanswer <b>") == ("plan", "answer <b>")
    assert split_reasoning("plan</think>answer") == ("plan", "answer")  # the template opened it (DeepSeek-R1)
    assert split_reasoning("  no tags\n") == ("", "  no tags\n")  # unchanged
    assert split_reasoning("<think>unfinished") == ("unfinished", "")
    assert split_reasoning("<think>a</think>b</think>c") == ("a", "b</think>c")  # the first close ends it
    assert split_reasoning("<think>a</think>b", None) == ("", "<think>a</think>b")


def test_tool_environment_scores_the_answer_without_the_reasoning():
    from rlbolt.agents import ToolEnvironment

    def lookup(key: str) -> str:
        """Looks up.

        Args:
            key: the key.
        """
        raise AssertionError("a call inside the reasoning must not run")

    seen = []
    env = ToolEnvironment([{"role": "user", "content": "q"}], [lookup], lambda a: seen.append(a) or 1.0,
                          HermesToolParser())
    result = env.step(f"<think>maybe {THOUGHT_CALL}? no.</think>\n7")
    assert result.done and result.reward == 1.0 and result.tool_calls == 0 and seen == ["7"]
