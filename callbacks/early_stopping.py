"""EarlyStopping: stop fit when a monitored metric has not improved for `patience` checks.

A `val/...` metric is checked at each validation (`on_validation_end`: the Evaluation that
`fit(val_data=...)` installs, or a user's); any other name is checked after every step
against `StepInfo.metrics` (e.g. "reward/mean"). Stopping calls `run.control.request_stop()`, so the
Trainer ends after the current step with the usual fit-end hooks (final checkpoint, logs).

`state_dict` holds the best value, its step and the checks since, so a resumed run stops at
exactly the step an uninterrupted one would.
"""

from __future__ import annotations

import logging
import math

from rlbolt.callback import Callback
from rlbolt.run_info import RunInfo
from rlbolt.state import StepInfo

log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Asks the run to stop (`run.control.request_stop()`) when `monitor` stops improving.

    A check improves when `value > best + min_delta` (mode "max") or `value < best - min_delta`
    (mode "min"); the first finite value always improves. A non-finite value never improves.
    After `patience` checks in a row without improvement the run stops.

    Args:
      monitor: the metric name: "val/<name>" (checked at validation) or a step metric ("reward/mean").
      mode: "max" or "min".
      patience: checks without improvement before stopping (>= 1).
      min_delta: the least change that counts as an improvement (>= 0).

    Attributes:
      best: the best value so far (None before the first check).
      best_step: the step of `best`.
      wait: checks since the last improvement.
      stopped_step: the step at which it asked to stop (None: it has not).
    """

    def __init__(self, monitor: str = "val/accuracy", mode: str = "max", patience: int = 3, min_delta: float = 0.0):
        if mode not in ("max", "min"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): use 'max' or 'min'")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}) must be a positive integer")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping(min_delta={min_delta!r}) must be >= 0 (the sign follows mode)")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self.stopped_step: int | None = None

    @property
    def _on_validation(self) -> bool:
        return self.monitor.startswith("val/")

    @property
    def needs_periodic_validation(self) -> str | None:
        """Why this callback needs `fit` to validate every few steps (None: it does not).
        `rlbolt.fit_checks.check_fit` refuses a fit that would never give it a value."""
        return f"EarlyStopping(monitor={self.monitor!r}) is checked at each validation" if self._on_validation else None

    def on_step_end(self, run: RunInfo, info: StepInfo) -> None:
        if not self._on_validation:
            self.check(run, info.step, _pick(self.monitor, info.metrics, "step"))

    def on_validation_end(self, run: RunInfo, step: int, metrics: dict[str, float]) -> None:
        if self._on_validation:
            self.check(run, step, _pick(self.monitor, metrics, "validation"))

    def check(self, run: RunInfo, step: int, value: float) -> bool:
        """Records one value of the monitored metric; returns True when it asked the trainer to stop."""
        if self.improves(value):
            self.best, self.best_step, self.wait = value, step, 0
            return False
        self.wait += 1
        if self.wait < self.patience:
            return False
        run.control.request_stop()
        self.stopped_step = step
        log.info("EarlyStopping: %s did not improve for %d check(s) (best %s at step %s); stopping after step %d",
                 self.monitor, self.wait, self.best, self.best_step, step)
        return True

    def improves(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than `min_delta`."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state.get("best") is None else float(state["best"])
        self.best_step, self.wait, self.stopped_step = state.get("best_step"), int(state.get("wait", 0)), state.get("stopped_step")


def _pick(name: str, metrics: dict[str, float], where: str) -> float:
    if name not in metrics:
        raise KeyError(f"EarlyStopping(monitor={name!r}): no such {where} metric; available: {sorted(metrics)}. "
                       "Use one of those (validation metrics start with 'val/')")
    return float(metrics[name])
