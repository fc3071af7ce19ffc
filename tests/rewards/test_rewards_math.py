"""GSM8K-style answer extraction and equivalence, with and without math_verify."""

import sys
from fractions import Fraction

import pytest

from rlbolt.rewards.math_answers import (
    answers_match,
    extract_answer,
    gsm8k_reward,
    math_verify_available,
    parse_number,
)

# Realistic rows in GSM8K's own format: reasoning with <<calc>> annotations, then "#### N".
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
        "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes "
        "of babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she "
        "earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A company's revenue was $1,250,000 last year...",
        "answer": "The revenue grew to 1,250,000 + 250,000 = <<1250000+250000=1500000>>1,500,000"
        "\n#### 1,500,000",
    },
    {
        "question": "The temperature was 5 degrees and dropped 12 degrees. What is it now?",
        "answer": "5 - 12 = <<5-12=-7>>-7\n#### -7",
    },
]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GSM8K_ROWS[0]["answer"], "72"),
        (GSM8K_ROWS[2]["answer"], "1500000"),
        (GSM8K_ROWS[3]["answer"], "-7"),
        ("Adding up, 3 + 4 = 7. So the answer is \\boxed{7}.", "7"),
        ("First \\boxed{5}, no wait: \\boxed{\\frac{3}{4}}", "3/4"),
        ("<think>48/2 = 24, 48 + 24 = 72</think>\n<answer>72 clips</answer>", "72"),
        ("She earned $10.", "10"),
        ("The answer is $1,234.50.", "1234.50"),
        ("The final answer is: 18 dollars per day for 7 days.", "18"),
        ("The answer is -12.", "-12"),
        ("So about 45% of them.", "45"),
        ("Total change: -$5", "-5"),
        ("3 + 4 = 7 and 7 * 2 = 14", "14"),  # fallback: last number
        ("\\boxed{x = 5}", "5"),
        ("The answer is 0.5 meters.", "0.5"),
        ("I cannot solve this.", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_marker_priority_and_fallback_switch():
    # '####' wins over an earlier boxed value; the last '####' wins over earlier ones.
    assert extract_answer("\\boxed{3}\n#### 4\n#### 5") == "5"
    assert extract_answer("it is 12 and 13", fallback_last_number=False) is None
    # Symbolic spans are kept whole instead of collapsing to their last digit.
    assert extract_answer("\\boxed{\\frac{\\sqrt{2}}{2}}") == "\\frac{\\sqrt{2}}{2}"
    assert extract_answer("The answer is x+1.") == "x+1"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,234", Fraction(1234)),
        ("-3.5", Fraction(-7, 2)),
        ("$12", Fraction(12)),
        ("50%", Fraction(50)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("12.", Fraction(12)),
        (".5", Fraction(1, 2)),
        ("1,2,3", None),
        ("1/0", None),
        ("twelve", None),
        ("3 apples", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("with_math_verify", [True, False])
def test_numeric_equivalence_is_the_same_with_and_without_math_verify(monkeypatch, with_math_verify):
    if not with_math_verify:
        monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    elif not math_verify_available():
        pytest.skip("math_verify is not installed")
    assert math_verify_available() is with_math_verify
    assert answers_match("0.75", "3/4")
    assert answers_match("72.0", "72")
    assert answers_match("1500000", "1500000.0000001")  # within rel_tol=1e-6
    assert not answers_match("71", "72")
    assert not answers_match("0.33", "1/3")
    assert answers_match("0.33", "1/3", rel_tol=0.02)
    assert not answers_match(None, "72")


def test_symbolic_answers_need_math_verify(monkeypatch):
    pytest.importorskip("math_verify")
    assert answers_match("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}")
    assert answers_match("1+x", "x+1")
    assert not answers_match("\\sqrt{3}", "\\sqrt{2}")
    monkeypatch.setitem(sys.modules, "math_verify", None)
    # Without it only whitespace-insensitive string equality remains.
    assert not answers_match("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}")
    assert answers_match("x + 1", "x+1")
    assert answers_match("\\sqrt{2}/2", "\\sqrt{2}/2")


@pytest.mark.parametrize("with_math_verify", [True, False])
def test_gsm8k_reward_on_realistic_rows(monkeypatch, with_math_verify):
    if not with_math_verify:
        monkeypatch.setitem(sys.modules, "math_verify", None)
    completions = [
        "<think>April: 48. May: 48/2 = 24. Total 48 + 24 = 72.</think><answer>72</answer>",
        "She earns 12/60 = 0.2 dollars a minute, so 0.2 * 50 = $10.00. The answer is $10.",
        "Revenue is now $1,500,000.\n#### 1,500,000",
        "5 - 12 = -7, so the temperature is \\boxed{-7} degrees.",
    ]
    for row, completion in zip(GSM8K_ROWS, completions, strict=True):
        assert gsm8k_reward(completion, row) == 1.0, completion
    wrong = ["<answer>73</answer>", "The answer is 12.", "#### 1,500", "\\boxed{7}"]
    for row, completion in zip(GSM8K_ROWS, wrong, strict=True):
        assert gsm8k_reward(completion, row) == 0.0, completion
    assert gsm8k_reward("no idea", GSM8K_ROWS[0]) == 0.0
    # Bare gold answers (not GSM8K's solution text) work too.
    assert gsm8k_reward("so \\boxed{0.75}", {"answer": "3/4"}) == 1.0
    assert gsm8k_reward("so 0.75", {"answer": 0.75}) == 1.0


def test_gsm8k_reward_bad_rows_name_the_field():
    with pytest.raises(KeyError, match="answer_key"):
        gsm8k_reward("42", {"solution": "#### 42"})
    assert gsm8k_reward("42", {"solution": "#### 42"}, answer_key="solution") == 1.0
    with pytest.raises(ValueError, match="####"):
        gsm8k_reward("42", {"answer": "no number here"})
