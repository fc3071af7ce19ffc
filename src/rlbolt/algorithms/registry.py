"""Name -> group advantage estimator, so a config can say ``advantage: grpo``.

Every entry has the signature ``(rewards [N], group_ids [N]) -> advantages [N]``. Token-level
estimators (REINFORCE++, GAE) take more inputs and are called directly by their modules.
"""

from __future__ import annotations

from typing import Callable

import jax

from rlbolt.algorithms import advantages

GroupAdvantageFn = Callable[[jax.Array, jax.Array], jax.Array]

ADVANTAGE_ESTIMATORS: dict[str, GroupAdvantageFn] = {
    "grpo": advantages.grpo_advantages,
    "drgrpo": advantages.drgrpo_advantages,
    "rloo": advantages.rloo_advantages,
}


def get_advantage_estimator(name: str) -> GroupAdvantageFn:
    """Looks up a group advantage estimator by name.

    Args:
        name: "grpo", "drgrpo" or "rloo" (case, "-" and "_" are ignored: "Dr-GRPO" works).

    Returns:
        The estimator, ``(rewards [N], group_ids [N]) -> [N]``.
    """
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    if key not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    return ADVANTAGE_ESTIMATORS[key]
