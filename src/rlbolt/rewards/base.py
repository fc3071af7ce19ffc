"""The reward-function contract shared by every scorer in `rlbolt.rewards`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RewardFn(Protocol):
    """Scores one sample on the host.

    A reward function sees the completion text and the prompt row it answers (every field of
    the row, e.g. `sample["answer"]` or `sample["tests"]`) and returns a finite float. It may
    raise or hang: `RewardRunner` isolates each call, so a reward never has to guard itself.
    Extra behaviour is configured with keyword-only arguments bound by `functools.partial`.
    """

    def __call__(self, completion: str, sample: Mapping[str, Any]) -> float:
        """Scores one completion.

        Args:
            completion: the generated text (prompt excluded).
            sample: the prompt row's fields.

        Returns:
            The reward, a finite float.
        """
        ...


def reward_name(fn: Any) -> str:
    """A metric-friendly name for a reward callable (function name, partial's target, or class)."""
    target = getattr(fn, "func", fn)  # functools.partial keeps the wrapped function in .func
    name = getattr(target, "__name__", None) or type(target).__name__
    name = re.sub(r"[^\w.\-]+", "_", name).strip("_") or "reward"  # "<lambda>" -> "lambda"
    return name.removesuffix("_reward") or name
