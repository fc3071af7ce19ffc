"""Tool schemas from signatures and docstrings, and a runner that survives hostile tools."""

import threading
import time
from typing import Literal

import pytest

from rlbolt.agents import ToolRunner, as_tool, tool_schema
from rlbolt.agents.tools import result_text


def get_weather(city: str, days: int, unit: Literal["c", "f"] = "c", hourly: bool = False,
                tags: list[str] | None = None, extra: dict | None = None, scale: float = 1.0) -> str:
    """Gets the weather forecast.

    A second paragraph of the description.

    Args:
        city: the city's name,
            e.g. Paris.
        days: how many days ahead.
        unit: c or f.
        hourly: one entry per hour.
        tags: labels.
        extra: anything else.
        scale: a factor.

    Returns:
        text: the forecast.
    """
    return f"{city} {days}"


def test_schema_from_signature_and_docstring_matches_a_hand_written_one():
    assert tool_schema(get_weather) == {"type": "function", "function": {
        "name": "get_weather",
        "description": "Gets the weather forecast. A second paragraph of the description.",
        "parameters": {"type": "object", "required": ["city", "days"], "properties": {
            "city": {"type": "string", "description": "the city's name, e.g. Paris."},
            "days": {"type": "integer", "description": "how many days ahead."},
            "unit": {"type": "string", "enum": ["c", "f"], "description": "c or f."},
            "hourly": {"type": "boolean", "description": "one entry per hour."},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "labels."},
            "extra": {"type": "object", "description": "anything else."},
            "scale": {"type": "number", "description": "a factor."},
        }}}}


def test_schemas_that_cannot_be_described_are_refused_naming_the_parameter():
    def no_hint(x):
        return x

    def var_args(*items: str):
        return items

    def odd(x: set):
        return x

    with pytest.raises(ValueError, match=r"parameter 'x' has no type hint; annotate it"):
        tool_schema(no_hint)
    with pytest.raises(ValueError, match=r"\*items"):
        tool_schema(var_args)
    with pytest.raises(ValueError, match=r"parameter 'x'.*has no JSON type"):
        tool_schema(odd)
    with pytest.raises(ValueError, match="needs a name"):
        tool_schema(lambda x: x)


def raises(x: str) -> str:
    """Always fails."""
    raise RuntimeError("disk on fire")


def exits(x: str) -> str:
    """Raises SystemExit, which must not end the caller."""
    raise SystemExit(3)


def huge(x: str) -> str:
    """Ten megabytes."""
    return "a" * (10 * 1024 * 1024)


def bad_bytes(x: str) -> bytes:
    """Bytes that are not UTF-8."""
    return b"ok \xff\xfe\x80 end"


def surrogate(x: str) -> str:
    """A string with a lone surrogate (cannot be encoded)."""
    return "a\ud800b"


class Unprintable:
    def __str__(self):
        raise ValueError("no str")


def unprintable(x: str) -> object:
    """Returns an object whose str() raises."""
    return Unprintable()


RELEASE = threading.Event()


def hangs(x: str) -> str:
    """Blocks until the test releases it."""
    RELEASE.wait(30)
    return "late"


def test_every_hostile_tool_becomes_text_and_the_good_one_still_answers():
    runner = ToolRunner(timeout_s=0.5, max_result_chars=100)
    good = as_tool(get_weather)
    calls = [(as_tool(f), {"x": "q"}) for f in (raises, exits, huge, bad_bytes, surrogate, unprintable, hangs)]
    outcomes = runner.run_many(calls + [(good, {"city": "Oslo", "days": 2})])
    RELEASE.set()
    by_name = dict(zip(["raises", "exits", "huge", "bad_bytes", "surrogate", "unprintable", "hangs", "good"], outcomes))
    assert not by_name["raises"].ok and "RuntimeError: disk on fire" in by_name["raises"].text
    assert not by_name["exits"].ok and "SystemExit" in by_name["exits"].text
    assert by_name["huge"].ok and by_name["huge"].truncated
    assert by_name["huge"].text.startswith("a" * 100) and "10485760 characters" in by_name["huge"].text
    assert len(by_name["huge"].text) < 200
    assert by_name["bad_bytes"].ok and by_name["bad_bytes"].text == "ok \ufffd\ufffd\ufffd end"
    assert by_name["surrogate"].text == "a?b" or by_name["surrogate"].text == "a\ufffdb"
    by_name["surrogate"].text.encode("utf-8")  # encodable now
    assert not by_name["unprintable"].ok and "cannot be shown" in by_name["unprintable"].text
    assert not by_name["hangs"].ok and "timed out after 0.5 s" in by_name["hangs"].text
    assert by_name["good"].ok and by_name["good"].text == "Oslo 2"


def test_bad_arguments_are_reported_without_calling_the_tool():
    called = []

    def tool(a: int) -> int:
        """Records its calls."""
        called.append(a)
        return a

    runner = ToolRunner(timeout_s=1.0)
    missing, unknown, not_a_dict = runner.run_many([(as_tool(tool), {}), (as_tool(tool), {"a": 1, "b": 2}),
                                                    (as_tool(tool), [1])])
    assert not missing.ok and "bad arguments" in missing.text and "['a']" in missing.text
    assert not unknown.ok and "bad arguments" in unknown.text
    assert not not_a_dict.ok and "must be a JSON object" in not_a_dict.text
    assert called == []


def test_stuck_calls_are_capped_then_fail_at_once():
    gate = threading.Event()

    def stuck(x: str) -> str:
        """Blocks."""
        gate.wait(30)
        return ""

    runner = ToolRunner(timeout_s=0.05, max_stuck=2)
    first = runner.run_many([(as_tool(stuck), {"x": ""})] * 2)
    assert all("timed out" in o.text for o in first)
    third = runner.run(as_tool(stuck), {"x": ""})
    assert "still stuck" in third.text and third.seconds == 0.0
    gate.set()
    for _ in range(100):  # the abandoned threads finish once released
        if runner.stuck() == 0:
            break
        time.sleep(0.01)
    assert runner.stuck() == 0


@pytest.mark.parametrize("value, expected", [(None, ""), (42, "42"), ({"a": [1, 2]}, '{"a": [1, 2]}'),
                                             ("é", "é"), (b"\xc3\xa9", "é")])
def test_result_text_of_plain_values(value, expected):
    assert result_text(value, 100) == (expected, False)


def test_result_text_cuts_long_bytes_with_a_note():
    text, cut = result_text(b"x" * 1000, 10)
    assert cut and text.startswith("x" * 10) and "1000 bytes" in text


@pytest.mark.parametrize("kwargs, field", [({"timeout_s": 0}, "timeout_s"),
                                           ({"max_result_chars": 0}, "max_result_chars")])
def test_runner_refuses_bad_settings_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ToolRunner(**kwargs)


def test_python_tool_runs_code_in_the_sandbox_and_reports_crashes_and_limits():
    from rlbolt.agents import python_tool

    tool = python_tool(wall_s=1.0)
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    printed, exited, looped = ToolRunner(timeout_s=30).run_many(
        [(tool, {"code": "print(6 * 7)"}), (tool, {"code": "import os; os._exit(3)"}),
         (tool, {"code": "while True: pass"})])
    assert printed.ok and printed.text == "42\n"
    assert exited.ok and "did not finish cleanly" in exited.text
    assert looped.ok and "did not finish cleanly" in looped.text
