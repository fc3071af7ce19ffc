"""The reward of a reasoning-gym task row: the task's own scorer on the completion's final answer.

A row from `rlbolt.data.reasoning_gym` names its task and options; the scorer is
`reasoning_gym.create_dataset(task, **options).score_answer(answer, entry)`, rebuilt once per
(task, options) in each process, so the reward pickles as a plain function and runs in
RewardRunner's worker processes.

The scorer must see the *final answer*, not the completion. Given the whole text, reasoning-gym
scorers give partial credit `len(gold) / len(text)` whenever the gold answer is a substring
(`"1 2 3 ... 214 ..."` earns credit for gold 214), which a policy learns to exploit by listing
candidates. So the answer is extracted first:

- `extract="auto"` (default): for a numeric gold answer, rlbolt's math extraction (`#### N`,
  `\\boxed{}`, `<answer>N</answer>`, "the answer is N", else the last number: one number);
  otherwise the content of the last `<answer>...</answer>` tag, else the last non-empty line;
- `extract="answer_tag"`: the last `<answer>...</answer>` only (no tag: reward 0);
- `extract="last_number"`: rlbolt's math extraction whatever the gold answer is.

And an extracted answer that holds the gold answer among other text (compared without case)
scores 0 whatever the scorer says: that closes the substring credit, and scorers that compare
only a prefix (spell_backward pays 0.8 for the gold followed by anything). Other task-specific
partial credit (spell_backward's per-character credit for a near miss) is kept; `binary=True`
rounds every score below 1 down to 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from rlbolt.rewards.math_answers import extract_answer, parse_number

__all__ = ["reasoning_gym_reward", "extract_task_answer"]

_EXTRACT_MODES = ("auto", "answer_tag", "last_number")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@lru_cache(maxsize=64)
def _scorer(task: str, options_json: str):
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("reasoning-gym task rewards need the reasoning-gym package: pip install 'rlbolt[tasks]'") from None
    return reasoning_gym.create_dataset(task, seed=0, size=1, **json.loads(options_json)).score_answer


def _import_reasoning_gym() -> None:
    """`reasoning_gym_reward.warm_up`: importing reasoning-gym loads every task it has (seconds on a
    loaded machine), which must not count against the first sample's reward time-out."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        pass  # the first sample then fails with the install hint, counted as a failure


def extract_task_answer(completion: str, gold: str, extract: str = "auto") -> str | None:
    """The final answer of a completion, as the task scorer should see it (see the module docstring).

    Args:
        completion: the generated text.
        gold: the row's gold answer (decides "auto"'s numeric path).
        extract: "auto", "answer_tag" or "last_number".

    Returns:
        The answer string, or None when the completion states none.
    """
    if extract not in _EXTRACT_MODES:
        raise ValueError(f"reasoning_gym_reward: extract={extract!r}; use one of {list(_EXTRACT_MODES)}")
    text = str(completion)
    if extract == "last_number" or (extract == "auto" and parse_number(gold) is not None):
        return extract_answer(text)
    tagged = _ANSWER_TAG_RE.findall(text)
    if tagged:
        return tagged[-1].strip()
    if extract == "answer_tag":
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def reasoning_gym_reward(completion: str, sample: Mapping[str, Any], *, extract: str = "auto",
                         binary: bool = False) -> float:
    """The reasoning-gym task's score of the completion's extracted final answer.

    Args:
        completion: the generated text.
        sample: a row of `rlbolt.data.reasoning_gym_rows` (`task`, `task_options`, `answer`,
            `question`, `metadata`).
        extract: how the final answer is found ("auto", "answer_tag", "last_number").
        binary: 1.0 for a full score, 0.0 for anything less.

    Returns:
        A score in [0, 1].
    """
    missing = [key for key in ("task", "answer") if key not in sample]
    if missing:
        raise KeyError(f"reasoning_gym_reward: the sample has no field(s) {missing} (fields: {sorted(sample)}); "
                       "build the rows with rlbolt.data.reasoning_gym.reasoning_gym_rows")
    gold = str(sample["answer"])
    answer = extract_task_answer(completion, gold, extract)
    if answer is None or not answer:
        return 0.0
    options = json.dumps(dict(sample.get("task_options") or {}), sort_keys=True)
    entry = {"question": sample.get("question", ""), "answer": gold, "metadata": dict(sample.get("metadata") or {})}
    score = float(_scorer(str(sample["task"]), options)(answer, entry))
    folded, gold_folded = answer.strip().lower(), gold.strip().lower()
    if gold_folded and gold_folded in folded and folded != gold_folded:
        score = 0.0  # the answer holds the gold among other text: substring (or prefix) credit
    if binary and score < 1.0:
        score = 0.0
    return min(max(score, 0.0), 1.0)


reasoning_gym_reward.warm_up = _import_reasoning_gym  # run by reward workers when they start
