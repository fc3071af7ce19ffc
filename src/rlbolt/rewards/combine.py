"""A weighted sum of named reward functions, keeping each term's raw score for metrics."""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlbolt.rewards.base import RewardFn, reward_name

__all__ = ["RewardTermError", "WeightedReward", "as_weighted", "as_score"]


class RewardTermError(Exception):
    """A reward term raised, or returned something that is not a finite number.

    Attributes:
        term: the name of the term (as in `reward/<name>/mean`).
    """

    def __init__(self, term: str, message: str):
        super().__init__(message)
        self.term = term

    def __reduce__(self):  # picklable, so a worker process can send it back
        return (type(self), (self.term, self.args[0]))


def as_score(value: Any, name: str = "reward") -> float:
    """A reward function's return value as a float, refusing anything that is not a real number.

    Accepted: Python and NumPy reals (bools included: a pass/fail reward) and 0-d real arrays.
    Refused: strings (``"0.75"`` is a bug in the reward, not a score), containers, complex
    numbers, None, and NaN or infinities.

    Args:
        value: what the reward returned.
        name: the reward's name, for the message.

    Returns:
        ``float(value)``.

    Raises:
        RewardTermError: naming the reward, the value and its type.
    """
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    is_array = getattr(value, "shape", None) == () and kind is not None and kind in "biuf"
    if not (isinstance(value, numbers.Real) or is_array) or isinstance(value, (str, bytes)):
        raise RewardTermError(name, f"reward {name!r} returned {value!r} ({type(value).__name__}), not a number")
    score = float(value)
    if not math.isfinite(score):
        raise RewardTermError(name, f"reward {name!r} returned {score}, not a finite number")
    return score


class WeightedReward:
    """`total = sum_k weight_k * fn_k(completion, sample)` over named terms.

    The raw (unweighted) score of each term is kept so a runner can log
    `reward/<name>/mean`. Instances are picklable when their functions are (module-level
    functions or `functools.partial` of them), which the process executor needs.

    Args:
        terms: `(name, fn, weight)` triples. Names must be unique and metric-safe
            (letters, digits, `_`, `-`, `.`); weights must be finite.

    Example:
        >>> reward = WeightedReward([("accuracy", gsm8k_reward, 1.0), ("format", format_reward, 0.2)])
        >>> reward.raw_scores(completion, sample)   # {"accuracy": 1.0, "format": 0.75}
        >>> reward(completion, sample)              # 1.15
    """

    def __init__(self, terms: Sequence[tuple[str, RewardFn, float]]):
        if not terms:
            raise ValueError("WeightedReward: terms is empty; pass [(name, fn, weight), ...]")
        seen = set()
        for position, term in enumerate(terms):
            if len(term) != 3:
                raise ValueError(
                    f"WeightedReward: terms[{position}]={term!r} must be a (name, fn, weight) triple"
                )
            name, fn, weight = term
            if not isinstance(name, str) or not re.fullmatch(r"[\w.\-]+", name):
                raise ValueError(
                    f"WeightedReward: terms[{position}] name={name!r} must be a non-empty string of "
                    f"letters, digits, '_', '-' or '.' (it becomes the metric reward/<name>/mean)"
                )
            if name in seen:
                raise ValueError(f"WeightedReward: duplicate name {name!r}; give each term its own")
            seen.add(name)
            if not callable(fn):
                raise TypeError(f"WeightedReward: terms[{position}] ({name!r}) fn={fn!r} is not callable")
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(
                    f"WeightedReward: terms[{position}] ({name!r}) weight={weight!r} must be a finite number"
                )
        self.terms = [(name, fn, float(weight)) for name, fn, weight in terms]

    @property
    def names(self) -> list[str]:
        """Term names in order."""
        return [name for name, _, _ in self.terms]

    @property
    def weights(self) -> dict[str, float]:
        """Weight of each term by name."""
        return {name: weight for name, _, weight in self.terms}

    def warm_up(self) -> None:
        """Runs each term's `warm_up()` (an attribute of the function, or of a `functools.partial`'s
        function): slow first-call work such as importing a task library, done when a worker starts
        instead of inside the first sample's time-out. A term without one is skipped; one that raises
        is logged and skipped (its samples then do the work, and fail or time out there, counted)."""
        for name, fn, _ in self.terms:
            hook = getattr(fn, "warm_up", None) or getattr(getattr(fn, "func", None), "warm_up", None)
            if callable(hook):
                try:
                    hook()
                except Exception as error:  # noqa: BLE001 - the same in a worker process and a thread
                    logging.getLogger(__name__).warning("reward %r: warm_up raised %r; its samples do that work "
                                                        "inside their time-out", name, error)

    def raw_scores(self, completion: str, sample: Mapping[str, Any]) -> dict[str, float]:
        """Each term's unweighted score for one sample.

        Args:
            completion: the generated text.
            sample: the prompt row.

        Returns:
            `{name: score}`.

        Raises:
            RewardTermError: a term raised (chained to its exception) or returned something
                that is not a finite real number (see `as_score`).
        """
        scores = {}
        for name, fn, _ in self.terms:
            try:
                value = fn(completion, sample)
            except Exception as error:  # name the term; the traceback stays chained
                raise RewardTermError(name, f"reward {name!r} raised {type(error).__name__}: {error}") from error
            scores[name] = as_score(value, name)
        return scores

    def combine(self, scores: Mapping[str, float]) -> float:
        """The weighted total of raw scores produced by `raw_scores`."""
        return sum(weight * scores[name] for name, _, weight in self.terms)

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> float:
        """The weighted total for one sample (so a WeightedReward is itself a `RewardFn`)."""
        return self.combine(self.raw_scores(completion, sample))

    def __repr__(self) -> str:
        inner = ", ".join(f"({name!r}, {reward_name(fn)}, {weight})" for name, fn, weight in self.terms)
        return f"WeightedReward([{inner}])"


def as_weighted(reward: RewardFn | WeightedReward) -> WeightedReward:
    """Wraps a single reward function as a one-term WeightedReward named after the function."""
    if isinstance(reward, WeightedReward):
        return reward
    if not callable(reward):
        raise TypeError(f"expected a reward function or a WeightedReward, got {reward!r}")
    return WeightedReward([(reward_name(reward), reward, 1.0)])
