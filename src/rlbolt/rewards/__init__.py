"""Reward functions and the failure-isolated runner that scores a batch with them.

A reward function is `fn(completion: str, sample: Mapping) -> float` (`RewardFn`); combine
several with `WeightedReward` and score a batch with `RewardRunner`.

The runner (and NumPy) load on first use: a reward worker process imports this package to
unpickle its reward, and should start in milliseconds, not pay for what it never runs.
"""

import importlib

from rlbolt.rewards.base import RewardFn, reward_name
from rlbolt.rewards.combine import RewardTermError, WeightedReward, as_score, as_weighted
from rlbolt.rewards.format import digit_fraction_reward, format_reward, make_format_reward
from rlbolt.rewards.math_answers import (
    answers_match,
    extract_answer,
    gsm8k_reward,
    math_verify_available,
    parse_number,
)
from rlbolt.rewards.sandbox import SandboxResult, code_reward, extract_code, run_python_sandboxed

__all__ = [
    "RewardFailureError",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "RewardTermError",
    "SandboxResult",
    "WeightedReward",
    "answers_match",
    "as_score",
    "as_weighted",
    "code_reward",
    "digit_fraction_reward",
    "extract_code",
    "extract_answer",
    "format_reward",
    "gsm8k_reward",
    "make_format_reward",
    "math_verify_available",
    "parse_number",
    "reward_name",
    "run_python_sandboxed",
]

_LAZY = {name: "rlbolt.rewards.runner" for name in ("RewardFailureError", "RewardResult", "RewardRunner")}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlbolt.rewards' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
