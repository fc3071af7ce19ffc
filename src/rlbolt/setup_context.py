"""SetupContext: what a module's `setup` is told about the run, and all it may rely on.

The Trainer builds one per fit, frozen, and hands it to `RLModule.setup(context)` (also kept as
`module.context`, so later hooks read the same facts): the batch plan, the seed, the mode, and
the ShardingPlan of each role. A module never reaches into the Trainer for them.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from rlbolt.plan import BatchPlan

ROLES = ("train", "rollout", "reference", "teacher")


@dataclasses.dataclass(frozen=True)
class SetupContext:
    """The run as `RLModule.setup` sees it.

    Attributes:
      plan: the BatchPlan, as checked by `fit` (micro sizes filled in).
      seed: the Trainer's seed (model initialisation, rollout keys).
      mode: "sync" or "async".
      shardings: role ("train", "rollout", "reference", "teacher") -> `rlbolt.distributed.ShardingPlan`; empty
        when the module is set up outside a fit (everything on the default device).
    """

    plan: BatchPlan
    seed: int = 0
    mode: str = "sync"
    shardings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, BatchPlan):
            raise TypeError(f"SetupContext(plan=...) must be a BatchPlan, got {type(self.plan).__name__}")
        unknown = set(self.shardings) - set(ROLES)
        if unknown:
            raise ValueError(f"SetupContext(shardings=...) has unknown role(s) {sorted(unknown)}; roles: {list(ROLES)}")
        object.__setattr__(self, "shardings", types.MappingProxyType(dict(self.shardings)))

    def sharding_for(self, role: str) -> Any:
        """The ShardingPlan of `role` ("train", "rollout", "reference", "teacher"): the training plan for a role
        without devices of its own, None outside a fit."""
        if role not in ROLES:
            raise ValueError(f"sharding_for({role!r}): roles are {list(ROLES)}")
        return self.shardings.get(role, self.shardings.get("train"))
