"""Final-answer extraction and equivalence for GSM8K-style math tasks.

A completion's answer is found by the first of these that appears (its *last* occurrence wins,
since models often restate intermediate values before concluding):

1. `#### 42` (GSM8K's own marker; the dataset's `answer` field ends with it),
2. `\\boxed{42}` (braces matched, so `\\boxed{\\frac{3}{4}}` works),
3. `<answer>42</answer>`,
4. "The answer is 42" / "answer: 42",
5. otherwise the last number in the text (`fallback_last_number=True`).

Numbers are cleaned of `$`, thousands commas, `%`, a trailing period and spaces; `3/4`,
`\\frac{3}{4}`, negatives and decimals parse to exact fractions. Two plain numbers are equal when
they agree within a tolerance. Anything that is not a plain number (`\\sqrt{2}/2`, `x+1`) is
compared with `math_verify` (Hugging Face's sympy-based checker) when it is installed, and by
whitespace-insensitive string equality when it is not.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

__all__ = [
    "answers_match",
    "extract_answer",
    "gsm8k_reward",
    "math_verify_available",
    "parse_number",
]

_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # thousands groups only when they are exact
_REAL = rf"(?:{_INT}(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(
    rf"(?<![\w.])(-\s*)?({_REAL})(?:\s*/\s*({_REAL}))?"
)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?\s*[\d.,]+)\s*\}\s*\{\s*(-?\s*[\d.,]+)\s*\}")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
_HASHES_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_IS_RE = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|=|:)\s*:?\s*([^\n]*)", re.IGNORECASE
)
# A span is "symbolic" (not a plain number) when it uses LaTeX beyond fractions/text, powers,
# roots, or a letter inside an arithmetic expression ("x+1"); units words ("5 apples") are not.
_SYMBOLIC_RE = re.compile(
    r"\\(?![dt]?frac\b|text\b|mathrm\b|textbf\b|mbox\b|[$%,!;: ])[a-zA-Z]+"
    r"|[\^√π∞]"
    r"|(?<![a-zA-Z])[a-zA-Z]\s*[-+*/]\s*[\w(\\]|[\w)]\s*[-+*/]\s*[a-zA-Z](?![a-zA-Z])"
)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")


def math_verify_available() -> bool:
    """Whether `math_verify` can be imported (it is an optional dependency: `rlbolt[math]`)."""
    return _load_math_verify() is not None


def _load_math_verify():
    # Imported per call (a dict lookup once cached) so tests can hide it via sys.modules.
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}`, with nested braces matched."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                found.append(text[start:pos])
                break
    return found


def _clean(span: str) -> str:
    span = _LATEX_TEXT_RE.sub(r" \1 ", span)
    span = _LATEX_FRAC_RE.sub(r"\1/\2", span)
    span = span.replace("\u2212", "-")  # unicode minus sign
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\left", "\\right"):
        span = span.replace(junk, "")
    return span.strip()


def _numbers(span: str) -> list[str]:
    """Every number in a cleaned span as a canonical string: no commas or spaces, sign kept."""
    out = []
    for match in _NUMBER_RE.finditer(span):
        sign, numerator, denominator = match.groups()
        token = ("-" if sign else "") + numerator.replace(",", "")
        if denominator is not None:
            token += "/" + denominator.replace(",", "")
        out.append(token)
    return out


def parse_number(text: str) -> Fraction | None:
    """Parses a whole string as one exact number, or returns None.

    Accepts `1,234`, `-3.5`, `$12`, `50%`, `3/4`, `\\frac{3}{4}`, `12.` (trailing period).

    Args:
        text: a candidate answer, e.g. the output of `extract_answer`.

    Returns:
        The value as a `Fraction`, or None when `text` is not exactly one number.
    """
    cleaned = _clean(str(text)).rstrip(".").strip()
    match = _NUMBER_RE.fullmatch(cleaned)
    if match is None:
        return None
    sign, numerator, denominator = match.groups()
    value = Fraction(numerator.replace(",", ""))
    if denominator is not None:
        divisor = Fraction(denominator.replace(",", ""))
        if divisor == 0:
            return None
        value /= divisor
    return -value if sign else value


def _answer_from_span(span: str, pick: str) -> str | None:
    cleaned = _clean(span)
    if "=" in cleaned:  # "x = 5" -> "5"
        cleaned = cleaned.rsplit("=", 1)[1].strip()
    if not cleaned:
        return None
    if _SYMBOLIC_RE.search(cleaned):
        return cleaned.rstrip(".").strip()
    numbers = _numbers(cleaned)
    if numbers:
        return numbers[0] if pick == "first" else numbers[-1]
    return cleaned.rstrip(".").strip() or None


def extract_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """Extracts the final answer from a completion or a GSM8K `answer` field.

    Args:
        text: the completion (or gold solution) text.
        fallback_last_number: when no marker is found, use the last number in the text.

    Returns:
        A canonical number string (`"1234"`, `"-0.5"`, `"3/4"`) when the answer is numeric, the
        cleaned answer span (`"\\sqrt{2}/2"`) when it is symbolic, or None when nothing is found.
    """
    text = str(text)
    # `pick` says which number of a multi-number span is the answer: the marker's immediate
    # value for "#### 18 dollars per 3 days", the final value for "\boxed{2 + 3 = 5}".
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return _answer_from_span(hashes[-1], "first")
    boxed = _boxed_contents(text)
    if boxed:
        return _answer_from_span(boxed[-1], "last")
    tagged = _ANSWER_TAG_RE.findall(text)
    if tagged:
        return _answer_from_span(tagged[-1], "last")
    stated = _ANSWER_IS_RE.findall(text)
    if stated:
        sentence = _SENTENCE_END_RE.split(stated[-1], maxsplit=1)[0]
        answer = _answer_from_span(sentence, "first")
        if answer is not None:
            return answer
    if fallback_last_number:
        numbers = _numbers(_clean(text))
        return numbers[-1] if numbers else None
    return None


def _math_verify_equal(module, predicted: str, gold: str) -> bool:
    # math_verify's own time-outs use SIGALRM, which only works on the main thread; elsewhere
    # (RewardRunner's workers) they are turned off and the runner enforces the time-out.
    on_main = threading.current_thread() is threading.main_thread()
    limit = 5 if on_main else None
    gold_parsed = module.parse(f"${gold}$", parsing_timeout=limit)
    predicted_parsed = module.parse(f"${predicted}$", parsing_timeout=limit)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(module.verify(gold_parsed, predicted_parsed, timeout_seconds=limit))


def answers_match(
    predicted: str | None,
    gold: str | None,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-6,
    use_math_verify: bool = True,
) -> bool:
    """Whether two extracted answers are equivalent.

    Plain numbers compare exactly as fractions within `max(abs_tol, rel_tol * |gold|)`.
    Otherwise `math_verify` decides (symbolic equivalence) when installed and enabled; without
    it, the answers must be equal as strings after removing whitespace.

    Args:
        predicted: the model's answer (from `extract_answer`), or None.
        gold: the reference answer, or None.
        rel_tol: relative tolerance for numbers.
        abs_tol: absolute tolerance for numbers.
        use_math_verify: allow the `math_verify` path for non-numeric answers.

    Returns:
        True when the answers agree; False when either is None.
    """
    if predicted is None or gold is None:
        return False
    predicted_value, gold_value = parse_number(predicted), parse_number(gold)
    if predicted_value is not None and gold_value is not None:
        tolerance = max(Fraction(abs_tol), Fraction(rel_tol) * abs(gold_value))
        return abs(predicted_value - gold_value) <= tolerance
    module = _load_math_verify() if use_math_verify else None
    if module is not None and _math_verify_equal(module, str(predicted), str(gold)):
        return True
    return re.sub(r"\s+", "", str(predicted)) == re.sub(r"\s+", "", str(gold))


def gsm8k_reward(
    completion: str,
    sample: Mapping[str, Any],
    *,
    answer_key: str = "answer",
    fallback_last_number: bool = True,
    use_math_verify: bool = True,
) -> float:
    """1.0 when the completion's final answer equals the sample's gold answer, else 0.0.

    Args:
        completion: the generated text.
        sample: the prompt row; `sample[answer_key]` is GSM8K's solution text ending in `#### N`
            or a bare answer (`"18"`, `18`, `"3/4"`).
        answer_key: which field holds the gold answer.
        fallback_last_number: accept the completion's last number when it has no answer marker.
        use_math_verify: allow `math_verify` for symbolic answers.

    Returns:
        1.0 or 0.0.
    """
    if answer_key not in sample:
        raise KeyError(
            f"gsm8k_reward: the sample has no field {answer_key!r} (fields: {sorted(sample)}); "
            f"pass answer_key= to name the field holding the gold answer"
        )
    gold = extract_answer(str(sample[answer_key]))
    if gold is None:
        raise ValueError(
            f"gsm8k_reward: no answer found in sample[{answer_key!r}]="
            f"{str(sample[answer_key])[:80]!r}; it should end with '#### <number>' or be the answer"
        )
    predicted = extract_answer(completion, fallback_last_number=fallback_last_number)
    return 1.0 if answers_match(predicted, gold, use_math_verify=use_math_verify) else 0.0
