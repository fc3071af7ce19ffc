"""Reward functions and the failure-isolated runner that scores a batch with them.

A reward function is `fn(completion: str, sample: Mapping) -> float` (`RewardFn`); combine
several with `WeightedReward` and score a batch with `RewardRunner`.
"""

from rlbolt.rewards.base import RewardFn, reward_name
from rlbolt.rewards.combine import WeightedReward, as_weighted
from rlbolt.rewards.format import format_reward, make_format_reward
from rlbolt.rewards.math_answers import (
    answers_match,
    extract_answer,
    gsm8k_reward,
    math_verify_available,
    parse_number,
)
from rlbolt.rewards.runner import RewardResult, RewardRunner
from rlbolt.rewards.sandbox import SandboxResult, code_reward, extract_code, run_python_sandboxed

__all__ = [
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "SandboxResult",
    "WeightedReward",
    "answers_match",
    "as_weighted",
    "code_reward",
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
