"""`reward.weights`: the reward terms a config can name, each registered where it is built.

A term is a maker `maker(answer_field) -> RewardFn` (`answer_field`: the prompt-row field holding
the gold answer); `rlbolt.modules.rewarding.build_reward` weighs the terms a config names. Adding
one touches one file, the one that registers it (imported before the config is read):

    @register_reward_term("length")
    def length_term(answer_field):
        return lambda completion, row: min(len(completion), 100) / 100

JAX-free, like the rest of the package, so a reward worker process imports it cheaply.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from rlbolt.rewards.base import RewardFn
from rlbolt.rewards.environment import env_reward
from rlbolt.rewards.format import digit_fraction_reward, make_format_reward
from rlbolt.rewards.math_answers import gsm8k_reward
from rlbolt.rewards.task_reward import reasoning_gym_reward
from rlbolt.utils.registry import Registry

TermMaker = Callable[[str], RewardFn]

REWARD_TERMS: Registry[TermMaker] = Registry("reward term", "reward.weights", ready=("rlbolt.rewards.terms",))


def register_reward_term(name: str) -> Callable[[TermMaker], TermMaker]:
    """A decorator registering `maker(answer_field) -> RewardFn` as the term `reward.weights: {name: w}`.

    Args:
      name: the key a config gives in reward.weights.

    Returns:
      The decorator; it returns the maker unchanged.
    """
    def register(maker: TermMaker) -> TermMaker:
        return REWARD_TERMS.register(name, maker, owner=f"{maker.__module__}.{maker.__qualname__}")

    return register


@register_reward_term("answer")
def answer_term(answer_field: str) -> RewardFn:
    """The GSM8K final answer against the row's gold answer, 0/1 (`gsm8k_reward`)."""
    return functools.partial(gsm8k_reward, answer_key=answer_field)


@register_reward_term("format")
def format_term(answer_field: str) -> RewardFn:
    """Think/answer tags, 0..1 (`make_format_reward`)."""
    return make_format_reward()


@register_reward_term("digits")
def digits_term(answer_field: str) -> RewardFn:
    """The fraction of digit characters (`digit_fraction_reward`): a dense signal for smoke runs."""
    return digit_fraction_reward


@register_reward_term("task")
def task_term(answer_field: str) -> RewardFn:
    """A reasoning-gym row's own scorer on the extracted answer (`reasoning_gym_reward`)."""
    return reasoning_gym_reward


@register_reward_term("env")
def env_term(answer_field: str) -> RewardFn:
    """An episode's environment rewards, summed (`env_reward`; with rollout.env)."""
    return env_reward
