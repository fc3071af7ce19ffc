"""Built-in GSM8K-style rows: seeded synthetic arithmetic word problems for CPU smoke runs.

Each row looks like a GSM8K row, `{"question": str, "answer": "<worked steps>\\n#### <N>"}`, so
the same reward (`rlbolt.rewards.gsm8k_reward`) and recipes run on it and on the real data set.
The text uses printable ASCII only, so the built-in character tokenizer can encode it.
"""

from __future__ import annotations

import numpy as np

_NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jack")
_ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards")

# (question template, worked-answer template, answer function) over two or three numbers a, b, c.
_TEMPLATES = (
    ("{n} has {a} {i}. {n} buys {b} more. How many {i} does {n} have now?",
     "{a} + {b} = {r}", lambda a, b, c: a + b),
    ("{n} has {a} {i} and gives {b} away. How many {i} are left?",
     "{a} - {b} = {r}", lambda a, b, c: a - b),
    ("{n} fills {a} boxes with {b} {i} each. How many {i} is that in total?",
     "{a} * {b} = {r}", lambda a, b, c: a * b),
    ("{n} has {a} {i}, finds {b} more, then loses {c}. How many {i} does {n} have?",
     "{a} + {b} = {s}, {s} - {c} = {r}", lambda a, b, c: a + b - c),
    ("{n} buys {a} packs of {b} {i} and already had {c}. How many {i} does {n} have?",
     "{a} * {b} = {s}, {s} + {c} = {r}", lambda a, b, c: a * b + c),
)


def gsm8k_style_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Generates `n` arithmetic word problems with GSM8K-format answers.

    Args:
      n: number of rows.
      seed: the generator seed; the same (n, seed) always gives the same rows, and the first k
        rows of a larger n equal the rows for k.

    Returns:
      A list of `{"question": ..., "answer": "<steps>\\n#### <int>"}` rows; answers are >= 0.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"gsm8k_style_rows: n={n!r} must be a non-negative int")
    rows = []
    for index in range(n):
        rng = np.random.default_rng([seed, index])  # per-row stream: a prefix stays a prefix
        question, steps, fn = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
        a, b = int(rng.integers(2, 20)), int(rng.integers(1, 10))
        if fn(a, b, 0) < 0:
            a, b = b, a
        partial = a * b if "*" in steps.split(",")[0] else a + b
        c = int(rng.integers(1, partial + 1)) if "- {c}" in steps else int(rng.integers(1, 10))
        result = fn(a, b, c)
        name, item = _NAMES[int(rng.integers(len(_NAMES)))], _ITEMS[int(rng.integers(len(_ITEMS)))]
        rows.append({
            "question": question.format(n=name, i=item, a=a, b=b, c=c),
            "answer": steps.format(a=a, b=b, c=c, s=partial, r=result) + f"\n#### {result}",
        })
    return rows
