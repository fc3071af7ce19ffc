"""The policy objectives by name, for the LM module's loss: they are registered beside their
code, `rlbolt.algorithms.objectives` (`OBJECTIVES`, `register_objective`).

`POLICY_LOSSES[name](logps, batch, algo)` is the registry itself; `COVARIANCE_SELECTIONS` the info
keys of the ready objectives' selected tokens (`objective_selections()` also has a user's).
"""

from __future__ import annotations

from rlbolt.algorithms.objectives import OBJECTIVES, objective_selections

POLICY_LOSSES = OBJECTIVES
COVARIANCE_SELECTIONS = objective_selections()
