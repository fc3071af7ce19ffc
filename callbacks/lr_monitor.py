"""LearningRateMonitor: add the learning rate of each step's last update to the step's metrics as `lr`.

Where the value comes from, first match wins:

1. an `optax.inject_hyperparams(...)` state anywhere in the optimizer state (also inside
   NaNGuard's `apply_if_finite` or an `optax.chain`): its `hyperparams["learning_rate"]`, which
   optax sets to the value the last update used;
2. a schedule the module's card declares (`RLModule.card().lr_schedule(count) -> lr`), evaluated at the count of
   the last update: `count - 1`, with `count` the first `ScaleByScheduleState.count` in the
   optimizer state (the counter optax feeds the schedule), else `TrainState.policy_version`.

The value is written into `StepInfo.metrics`, which callbacks later in the list see. So
LearningRateMonitor runs before MetricsLogger and ProgressBar (`order = -20`) whatever the
list order.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from rlbolt.callback import Callback
from rlbolt.run_info import RunInfo
from rlbolt.state import StepInfo, TrainState

_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def injected_learning_rate(opt_state: Any) -> float | None:
    """The `learning_rate` hyperparameter of the first inject_hyperparams state, or None."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _INJECTED)):
        if isinstance(node, _INJECTED) and "learning_rate" in node.hyperparams:
            return float(np.asarray(jax.device_get(node.hyperparams["learning_rate"])))
    return None


def schedule_count(state: TrainState) -> int:
    """Updates the schedule has seen: the first ScaleByScheduleState count, else the policy version."""
    for node in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)):
        if isinstance(node, optax.ScaleByScheduleState):
            return int(np.asarray(jax.device_get(node.count)))
    return int(state.policy_version)


class LearningRateMonitor(Callback):
    """Logs `lr`, the learning rate of each step's last optimizer update.

    Args:
      name: the metric name.

    Attributes:
      source: "inject_hyperparams" or "card.lr_schedule", chosen at fit start.
    """

    order = -20  # adds `lr` before the writers run

    def __init__(self, name: str = "lr"):
        self.name = name
        self.source: str | None = None
        self._schedule: Any = None

    def on_fit_start(self, run: RunInfo, state: TrainState) -> None:
        if injected_learning_rate(state.opt_state) is not None:
            self.source = "inject_hyperparams"
        elif run.card is not None and run.card.lr_schedule is not None:
            self.source, self._schedule = "card.lr_schedule", run.card.lr_schedule
        else:
            raise ValueError(
                f"LearningRateMonitor: {type(run.module).__name__}'s optimizer has no injected learning_rate and "
                "its card() declares no lr_schedule; build the optimizer with "
                "optax.inject_hyperparams(optax.adamw)(learning_rate=...) or return a ModuleCard with lr_schedule "
                "from the module's card()"
            )

    def step_metrics(self, run: RunInfo, info: StepInfo) -> dict[str, float]:
        return {self.name: self.learning_rate(info.state)}

    def learning_rate(self, state: TrainState) -> float:
        """The learning rate of the last update that produced `state`."""
        if self.source == "inject_hyperparams":
            return injected_learning_rate(state.opt_state)
        return float(np.asarray(self._schedule(max(schedule_count(state) - 1, 0))))
