"""Reward terms a config can name (`reward.weights: {answer: 1.0, format: 0.1}`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from rlbolt.rewards import WeightedReward, gsm8k_reward, make_format_reward
from rlbolt.rewards.format import digit_fraction_reward  # noqa: F401 - defined there so worker processes import it without JAX

REWARD_TERMS = ("answer", "format", "digits")


def build_reward(weights: Mapping[str, float], *, answer_field: str = "answer") -> WeightedReward:
    """A `WeightedReward` from `{term: weight}`; terms with weight 0 are left out.

    Args:
      weights: term -> weight, terms from REWARD_TERMS: "answer" (GSM8K final answer, 0/1),
        "format" (think/answer tags, 0..1), "digits" (`digit_fraction_reward`).
      answer_field: the prompt-row field holding the gold answer.

    Returns:
      The weighted reward.
    """
    unknown = [t for t in weights if t not in REWARD_TERMS]
    if unknown:
        raise ValueError(f"reward.weights has unknown term(s) {unknown}; known terms: {list(REWARD_TERMS)}")
    makers = {
        "answer": lambda: functools.partial(gsm8k_reward, answer_key=answer_field),
        "format": make_format_reward,
        "digits": lambda: digit_fraction_reward,
    }
    terms = [(name, makers[name](), float(w)) for name, w in weights.items() if w != 0]
    if not terms:
        raise ValueError(f"reward.weights={dict(weights)} gives every term weight 0; give at least one a weight")
    return WeightedReward(terms)


def answer_score(completion: str, row: Mapping[str, Any], answer_field: str) -> float:
    """1.0 when the completion's final answer matches the row's gold answer; 0.0 otherwise,
    including when the row's answer cannot be parsed (validation must not crash on one bad row)."""
    try:
        return gsm8k_reward(completion, row, answer_key=answer_field)
    except (KeyError, ValueError):
        return 0.0
