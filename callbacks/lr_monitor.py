"""LearningRateMonitor: add the learning rate of each step's last update to the step's metrics as `lr`.

Where the value comes from, first match wins:

1. an `optax.inject_hyperparams(...)` state anywhere in the optimizer state (also inside
   NaNGuard's `apply_if_finite` or an `optax.chain`): its `hyperparams["learning_rate"]`, which
   optax sets to the value the last update used;
2. a schedule the module exposes as `module.lr_schedule(count) -> lr`, evaluated at the count of
   the last update: `count - 1`, with `count` the first `ScaleByScheduleState.count` in the
   optimizer state (the counter optax feeds the schedule), else `TrainState.policy_version`.

The value is written into `StepInfo.metrics`, which callbacks later in the list see. So
LearningRateMonitor must come before MetricsLogger (and ProgressBar) in `Trainer(callbacks=[...])`;
fit start raises a ValueError naming the fix otherwise.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from rlbolt.callback import Callback
from rlbolt.state import StepInfo, TrainState

_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def check_before_writers(trainer, callback: Callback, adds: str) -> None:
    """Raises ValueError when a callback that writes or shows metrics runs before `callback`.

    Args:
      trainer: the Trainer (its `callbacks` list is inspected).
      callback: the callback that adds metrics in `on_step_end`.
      adds: the metric names it adds, for the message.
    """
    from rlbolt.callbacks.metrics import MetricsLogger
    from rlbolt.callbacks.progress import ProgressBar

    order = list(trainer.callbacks)
    mine = order.index(callback)
    early = [cb for cb in order[:mine] if isinstance(cb, (MetricsLogger, ProgressBar))]
    if early:
        name = type(callback).__name__
        raise ValueError(f"{name} adds {adds} to each step's metrics, so it must come before "
                         f"{type(early[0]).__name__} in Trainer(callbacks=[...]); move {name} earlier")


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
      source: "inject_hyperparams" or "module.lr_schedule", chosen at fit start.
    """

    def __init__(self, name: str = "lr"):
        self.name = name
        self.source: str | None = None

    def on_fit_start(self, trainer, state: TrainState) -> None:
        check_before_writers(trainer, self, f"{self.name!r}")
        if injected_learning_rate(state.opt_state) is not None:
            self.source = "inject_hyperparams"
        elif callable(getattr(trainer.module, "lr_schedule", None)):
            self.source = "module.lr_schedule"
        else:
            raise ValueError(
                f"LearningRateMonitor: {type(trainer.module).__name__}'s optimizer has no injected learning_rate and "
                "the module has no lr_schedule(count); build the optimizer with "
                "optax.inject_hyperparams(optax.adamw)(learning_rate=...) or define module.lr_schedule(count) -> lr"
            )

    def on_step_end(self, trainer, info: StepInfo) -> None:
        info.metrics[self.name] = self.learning_rate(trainer, info.state)

    def learning_rate(self, trainer, state: TrainState) -> float:
        """The learning rate of the last update that produced `state`."""
        if self.source == "inject_hyperparams":
            return injected_learning_rate(state.opt_state)
        return float(np.asarray(trainer.module.lr_schedule(max(schedule_count(state) - 1, 0))))
