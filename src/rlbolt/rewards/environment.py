"""The `env` reward term: an episode's environment rewards (`rlbolt.agents`), as a reward function.

`on_rollout` of a multi-turn run adds each sample's summed step rewards as the `env_reward`
column, which reward functions see as a field of the sample; this term reads it, so it combines
with the other terms of `reward.weights` (`{env: 1.0, format: 0.1}`) like any reward function.
Defined here, JAX-free, so reward worker processes import it cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def env_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """The episode's environment reward (`sample["env_reward"]`); KeyError when the sample was not
    produced by an episode (a run without rollout.env)."""
    return float(sample["env_reward"])
