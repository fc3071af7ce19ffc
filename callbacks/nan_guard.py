"""NaNGuard: stop on a non-finite loss or gradient norm (after checkpointing the last good state),
or skip the updates whose gradients are non-finite.

"stop" checks the watched metrics after every step. On a non-finite value at step k it saves
step k - 1's state through the ModelCheckpoint in the callback list, or through its own
synchronous one in `<run_dir>/checkpoints` when there is none, then raises `NonFiniteError`.
The update donates the arrays it replaces (`Trainer.donated`: they are deleted by the update,
and `StepInfo.previous_state` holds None for them), so before each step's updates "stop" copies
the donated fields to host memory (`pinned_host` where the backend has it, else NumPy; the
copy is dispatched before the update, which runs after it) and saves that copy; the rest of
step k - 1's state comes from `StepInfo.previous_state`. NaNGuard runs
before ModelCheckpoint (`order = -30`), so a non-finite step is never checkpointed.

"skip" wraps the module's optimizer in `optax.apply_if_finite`: an update whose gradients hold
a NaN or an infinity leaves params and optimizer state unchanged. The guard counts such updates
(`nan_guard/skipped_updates` in the step's metrics) and stops after `max_consecutive_skips`
steps in a row that skipped any update.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import optax

from rlbolt.callback import Callback
from rlbolt.run_info import RunInfo
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.callbacks.offload import Offloaded, host_memory_kind
from rlbolt.distributed.agree import any_process
from rlbolt.distributed.sharding import host_value
from rlbolt.state import StepInfo

log = logging.getLogger(__name__)
ACTIONS = ("stop", "skip")


class NonFiniteError(FloatingPointError):
    """A watched metric was NaN or infinite."""


class NaNGuard(Callback):
    """Stops (or skips updates) when the loss or gradient norm is not finite.

    Args:
      metrics: the step metrics to watch.
      action: "stop" (checkpoint step k - 1, then raise NonFiniteError) or "skip" (non-finite
        updates leave the state unchanged).
      max_consecutive_skips: "skip" only: raise after this many steps in a row skipped updates.
    """

    order = -30  # sees a non-finite step before anything saves it

    def __init__(self, metrics: Sequence[str] = ("loss", "grad_norm"), action: str = "stop",
                 max_consecutive_skips: int = 10):
        if action not in ACTIONS:
            raise ValueError(f"NaNGuard(action={action!r}); allowed: {ACTIONS}")
        if isinstance(metrics, str) or not metrics:
            raise ValueError(f"NaNGuard(metrics={metrics!r}): give a non-empty sequence of metric names")
        if max_consecutive_skips < 1:
            raise ValueError(f"NaNGuard(max_consecutive_skips={max_consecutive_skips}) must be >= 1")
        self.metrics, self.action, self.max_consecutive_skips = tuple(metrics), action, max_consecutive_skips
        self.skipped_updates = 0
        self._consecutive = 0
        self._skipped_now = 0  # skipped updates of the step in progress (step_metrics -> on_step_end)
        self.saved_step: int | None = None
        self._before: dict[str, Offloaded] = {}  # "stop": host copies of the fields the update donates

    def wrap_optimizer(self, run: RunInfo, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """Called by the Trainer before the state is built: "skip" makes non-finite updates no-ops."""
        if self.action != "skip":
            return tx
        # NaNGuard counts the consecutive failures itself; optax must never apply a bad update.
        return optax.apply_if_finite(tx, max_consecutive_errors=np.iinfo(np.int32).max)

    def on_update_start(self, run: RunInfo, state) -> None:
        """"stop": copies the fields the step's update donates (`run.donated`) to host memory."""
        if self.action == "stop":
            kind = host_memory_kind()
            self._before = {name: Offloaded(getattr(state, name), kind) for name in run.donated}

    def step_metrics(self, run: RunInfo, info: StepInfo) -> dict[str, float]:
        """skip mode: `nan_guard/skipped_updates`, the updates of this step that were skipped."""
        if self.action != "skip":
            return {}
        state = _find_apply_if_finite(info.state.opt_state)
        if state is None:
            return {}
        total = int(host_value(state.total_notfinite))
        self._skipped_now, self.skipped_updates = total - self.skipped_updates, total
        return {"nan_guard/skipped_updates": float(self._skipped_now)}

    def on_step_end(self, run: RunInfo, info: StepInfo) -> None:
        if self.action == "skip":
            self._count_skips(info.step)
            return
        bad = {k: info.metrics[k] for k in self.metrics if k in info.metrics and not math.isfinite(info.metrics[k])}
        if any_process(bool(bad)):  # every process saves and stops together (the save is a collective)
            good = info.previous_state.replace(**{name: copy.to_device() for name, copy in self._before.items()})
            self._stop(run, info.step, good, bad or {"loss on another process": float("nan")})

    def state_dict(self) -> dict:
        return {"skipped_updates": self.skipped_updates, "consecutive": self._consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self._consecutive = int(state.get("consecutive", 0))

    # -- helpers -----------------------------------------------------------------------------------
    def _stop(self, run: RunInfo, step: int, good, bad: dict[str, float]) -> None:
        """Saves `good` (the state before step `step`) and raises NonFiniteError."""
        checkpoints = [cb for cb in run.callbacks if isinstance(cb, ModelCheckpoint)]
        if checkpoints:
            saver = checkpoints[0]
            saver.save(run, good)
            saver.wait()
        else:
            saver = ModelCheckpoint(Path(run.run_dir) / "checkpoints", async_save=False, keep=None)
            saver.open(run)
            saver.save(run, good)
            saver.finish()
        self.saved_step = good.step
        names = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise NonFiniteError(f"step {step}: non-finite {names}; saved the last good state (step {good.step}) "
                             f"to {saver.directory}; resume with ModelCheckpoint(resume={good.step}) after fixing "
                             "the cause (lower the learning rate, check the reward and loss for division by zero)")

    def _count_skips(self, step: int) -> None:
        skipped_now, self._skipped_now = self._skipped_now, 0
        if skipped_now:
            self._consecutive += 1
            log.warning("step %d: skipped %d update(s) with non-finite gradients (%d in total)", step, skipped_now,
                        self.skipped_updates)
            if self._consecutive >= self.max_consecutive_skips:  # from replicated counts: equal on every process
                raise NonFiniteError(f"step {step}: {self._consecutive} consecutive steps skipped non-finite updates "
                                     f"(NaNGuard(max_consecutive_skips={self.max_consecutive_skips})); stopping")
        else:
            self._consecutive = 0


def _find_apply_if_finite(opt_state):
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState)):
        if isinstance(node, optax.ApplyIfFiniteState):
            return node
    return None
