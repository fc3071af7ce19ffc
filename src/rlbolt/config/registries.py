"""The config's choices that registries hold: each kind's names, read from the registry beside
the entries (`rlbolt.utils.registry.Registry`), so no list of them is kept here.

Importing this module is cheap: a registry's home is imported by name on the first look-up
(when a value is checked), as `rlbolt.config.algorithms` does for the algorithm classes.

    kind             registry                                   config field
    objectives       rlbolt.algorithms.objectives.OBJECTIVES    algorithm.policy_loss
    reward terms     rlbolt.rewards.terms.REWARD_TERMS          reward.weights keys
"""

from __future__ import annotations

import importlib
from typing import Any

from rlbolt.config.fields import ConfigError

_OBJECTIVES = ("rlbolt.algorithms.objectives", "OBJECTIVES")
_REWARD_TERMS = ("rlbolt.rewards.terms", "REWARD_TERMS")


def _registry(home: tuple[str, str]) -> Any:
    module, name = home
    return getattr(importlib.import_module(module), name)  # by name: the config layer stays light


def objective_names() -> tuple[str, ...]:
    """Every registered policy objective (`algorithm.policy_loss`), the ready ones first."""
    return _registry(_OBJECTIVES).names()


def objective_fills(name: str) -> dict[str, Any]:
    """The algorithm fields objective `name` fills when the config left them None (its paper's
    settings and aggregation).

    Raises:
      ConfigError: no objective has that name.
    """
    try:
        return _registry(_OBJECTIVES).get(name).fills()
    except KeyError as error:
        raise ConfigError(f"{error.args[0]}, or register yours (rlbolt.algorithms.register_objective) in the "
                          "file objects.module names") from None


def reward_term_names() -> tuple[str, ...]:
    """Every registered reward term (the keys `reward.weights` may use)."""
    return _registry(_REWARD_TERMS).names()
