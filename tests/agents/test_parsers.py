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
