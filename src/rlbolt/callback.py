"""Callback: no-op hooks a user overrides, a list that dispatches them, and periodic firing.

Every hook receives the run's frozen description first (`rlbolt.run_info.RunInfo`), never the
Trainer: a callback reads what it needs from it and acts through `run.control` (stop, validate).
A callback written against the old signature (first hook argument named `trainer`) still gets
the Trainer for one release, with a DeprecationWarning.

When a callback acts (`Periodic`) is kept apart from what it does (the hook body), so the same
schedule logic serves checkpoints, evaluation and logging and is tested once with a fake clock.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlbolt.run_info import Restore, RunInfo

HOOKS = (
    "wrap_optimizer",
    "on_restore",
    "on_fit_start",
    "on_step_start",
    "on_rollout_end",
    "on_update_start",
    "on_update_end",
    "on_step_end",
    "on_validation_end",
    "on_fit_end",
    "on_exception",
)


class Callback:
    """Base class: every hook does nothing. Hooks run on the main (training) thread, after the
    RLModule's own hook, in ascending `order` and, within one order, in the order the callbacks
    were given to the Trainer.

    Attributes:
      order: where this callback runs relative to others. Built-ins declare theirs so a user's
        list order cannot break them: metric producers run before metric writers (NaNGuard -30;
        LearningRateMonitor, Throughput -20), writers and most others at 0, ModelCheckpoint at 10
        (after a step's metrics are on disk), Evaluation at 20 (after the checkpoint recorded the
        step it may keep as best).
      writes_run_dir: True for a callback that writes into `run.run_dir`; `Trainer.fit`
        then locks the directory for the fit (one writer per run directory).
      needs_periodic_validation: why this callback needs mid-run validation (e.g. EarlyStopping on
        a `val/` metric), or None; `fit` refuses a run that never validates mid-run.
      saved_step: the newest step whose checkpoint this callback wrote or restored (None: it keeps
        none); the `rlbolt` command reports it after an interrupted run.

    These are every attribute the Trainer and the `rlbolt` command read from a callback.
    """

    order: int = 0
    writes_run_dir: bool = False
    needs_periodic_validation: str | None = None
    saved_step: int | None = None

    def wrap_optimizer(self, run: RunInfo, tx):
        """Once, before the state is built: may wrap the module's optax transformation (e.g.
        NaNGuard's `optax.apply_if_finite`). Returns the transformation to use."""
        return tx

    def on_restore(self, run: RunInfo, state) -> Any:
        """Once, before `on_fit_start`: may return what to restore, a `rlbolt.run_info.Restore`
        (the state, every callback's `state_dict`, the producer's retained weights) or a bare
        TrainState, which the Trainer applies (ModelCheckpoint resumes here), so every
        `on_fit_start` sees the state the run really starts from."""

    def on_fit_start(self, run: RunInfo, state) -> Any:
        """Once, before the first step (after `on_restore`). May return a replacement TrainState."""

    def on_step_start(self, run: RunInfo, step: int) -> None:
        """Before step `step` (0-based index of the step about to run) consumes its batch."""

    def on_rollout_end(self, run: RunInfo, rollout) -> None:
        """When the step's `ProducedStep` (batch + producer metrics) reaches the main thread."""

    def on_update_start(self, run: RunInfo, state) -> Any:
        """Before the step's optimizer updates. May return a replacement TrainState (CPUOffload
        moves the optimizer state to the device here)."""

    def on_update_end(self, run: RunInfo, state) -> Any:
        """After the step's optimizer updates, before `on_step_end`. May return a replacement
        TrainState (CPUOffload moves the optimizer state back to host memory here)."""

    def step_metrics(self, run: RunInfo, info) -> Mapping[str, float]:
        """Metrics this callback adds to the step (e.g. the learning rate, FLOP/s), before any
        `on_step_end` runs: `info.metrics` holds the step's metrics and what callbacks of a lower
        order added. Return new names only (a name already present is refused). Default: none.

        Not a hook of its own in the trace: it is how a step's metrics are completed, and the
        completed, read-only `StepInfo` is what every `on_step_end` receives."""
        return {}

    def on_step_end(self, run: RunInfo, info) -> None:
        """After the step's updates, with a `StepInfo` whose metrics are complete and read-only
        (`info.is_last`: the run's plan ends after this step)."""

    def on_validation_end(self, run: RunInfo, step: int, metrics: dict[str, float]) -> None:
        """After a validation pass, with its `val/*` metrics."""

    def on_fit_end(self, run: RunInfo, state) -> None:
        """Once, after the last step (not after an exception); also after a step that SIGINT/SIGTERM
        stopped, with `run.control.interrupted` True."""

    def on_exception(self, run: RunInfo, exc: BaseException) -> None:
        """When fit stops on an exception (KeyboardInterrupt included)."""

    def state_dict(self) -> dict:
        """What this callback needs to resume exactly (saved in every checkpoint)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores what `state_dict` returned."""

    @property
    def state_key(self) -> str:
        """The name under which this callback's state is checkpointed."""
        return type(self).__name__


class CallbackList(Callback):
    """Dispatches each hook to the callbacks that override it, in order (itself a Callback).

    Args:
      callbacks: the callbacks, sorted by `order` (stable: list order within one order).
      legacy: what an old-signature hook (first argument named `trainer`) receives instead of
        the RunInfo: the Trainer (deprecated; see `Callback`).
    """

    def __init__(self, callbacks: Sequence[Callback] = (), legacy: Any = None):
        self.callbacks = sorted(callbacks, key=lambda cb: cb.order)  # stable: list order within an order
        keys = [cb.state_key for cb in self.callbacks]
        dupes = {k for k in keys if keys.count(k) > 1}
        if dupes:
            raise ValueError(f"callbacks {sorted(dupes)} appear twice; give each a distinct `state_key`")
        self.legacy = legacy
        for cb in self.callbacks:
            old = [hook for hook in (*HOOKS, "step_metrics") if _overrides(cb, hook) and takes_trainer(getattr(cb, hook))]
            if old:
                warnings.warn(f"{type(cb).__name__}.{old[0]} takes `trainer`: callback hooks now receive the run's "
                              "RunInfo (`run`) instead of the Trainer; rename the argument and read `run.run_dir`, "
                              "`run.control.request_stop()`... The old signature stops working in the next release",
                              DeprecationWarning, stacklevel=3)
        for hook in HOOKS:
            overriding = [self._adapt(getattr(cb, hook)) for cb in self.callbacks if _overrides(cb, hook)]
            setattr(self, hook, _dispatcher(hook, overriding))

    def __iter__(self):
        return iter(self.callbacks)

    def _adapt(self, method: Callable) -> Callable:
        """`method` itself, or for an old-signature hook a function that passes `self.legacy` first."""
        if not takes_trainer(method):
            return method

        def legacy(run, *args, **kwargs):
            return method(self.legacy if self.legacy is not None else run, *args, **kwargs)

        legacy.__qualname__ = method.__qualname__
        return legacy

    def add_step_metrics(self, run: RunInfo, info):
        """`info` with every callback's `step_metrics` added, in order, as a read-only mapping.

        Raises:
          ValueError: a callback returned a metric name the step already has (one home per metric).
        """
        metrics = dict(info.metrics)
        for cb in self.callbacks:
            if type(cb).step_metrics is Callback.step_metrics:
                continue
            added = self._adapt(cb.step_metrics)(run, dataclasses.replace(info, metrics=types.MappingProxyType(metrics)))
            clash = sorted(set(added or {}) & set(metrics))
            if clash:
                raise ValueError(f"{type(cb).__name__}.step_metrics returned {clash}, which the step already has; "
                                 "give the metric another name")
            metrics.update({k: float(v) for k, v in (added or {}).items()})
        return dataclasses.replace(info, metrics=types.MappingProxyType(metrics))

    def find(self, kind: type) -> list[Callback]:
        return [cb for cb in self.callbacks if isinstance(cb, kind)]

    def state_dict(self) -> dict:
        return {cb.state_key: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, state: dict) -> None:
        for cb in self.callbacks:
            if cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])


def takes_trainer(method: Callable) -> bool:
    """Whether a hook has the old signature: its first argument (after self) is named `trainer`."""
    try:
        parameters = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return bool(parameters) and parameters[0] == "trainer"


def _overrides(cb: Callback, hook: str) -> bool:
    return getattr(type(cb), hook) is not getattr(Callback, hook)


def _dispatcher(hook: str, methods: list[Callable]) -> Callable:
    if hook == "on_restore":

        def restore(run, state, apply: Callable[[Restore], Any] | None = None):
            """Each callback may return a `Restore` (applied by `apply`: the Trainer's) or a state."""
            for m in methods:
                result = m(run, state)
                if isinstance(result, Restore):
                    state = apply(result) if apply is not None else result.state
                elif result is not None:
                    state = result
            return state

        return restore
    if hook in ("wrap_optimizer", "on_fit_start", "on_update_start", "on_update_end"):

        def run_chain(run, value):
            for m in methods:  # each may replace the state / optimizer; later callbacks see it
                result = m(run, value)
                value = value if result is None else result
            return value

        return run_chain
    if hook == "on_exception":

        def run_all(run, exc):
            for m in methods:  # every callback gets its chance to clean up
                try:
                    m(run, exc)
                except Exception as inner:  # noqa: BLE001 - never mask the original exception
                    exc.add_note(f"callback {m.__qualname__} failed in on_exception: {inner!r}")

        return run_all

    def run_each(*args):
        for m in methods:
            m(*args)

    return run_each


class Periodic:
    """Decides when a periodic action fires: every n steps and/or every s seconds.

    Args:
      every_n_steps: fire when `step % every_n_steps == 0`.
      every_secs: fire when at least this many seconds passed since the last firing.
      clock: a zero-argument function returning seconds (injectable for tests).
      agree: with `every_secs`, agree across processes (a collective every process must join);
        False for a decision one process makes alone (what process 0 prints).
    Either condition fires; with neither set, `should_fire` is always False (use `force`).
    Clocks differ between processes, so with `every_secs` the processes agree (it fires on all
    when it fires on one): a periodic action may then be a collective such as a checkpoint.
    """

    def __init__(self, every_n_steps: int | None = None, every_secs: float | None = None,
                 clock: Callable[[], float] = time.monotonic, agree: bool = True):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1 (or None to disable)")
        if every_secs is not None and every_secs <= 0:
            raise ValueError(f"every_secs={every_secs} must be > 0 (or None to disable)")
        self.every_n_steps, self.every_secs, self.clock, self.agree = every_n_steps, every_secs, clock, agree
        self._last_time = clock()
        self._last_step: int | None = None

    def should_fire(self, step: int) -> bool:
        by_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        by_time = self.every_secs is not None and self.clock() - self._last_time >= self.every_secs
        if self.every_secs is not None and self.agree:
            from rlbolt.distributed.agree import any_process  # lazy: callbacks stay importable without JAX

            by_time = any_process(by_time)
        if (by_steps or by_time) and step != self._last_step:
            self.fired(step)
            return True
        return False

    def fired(self, step: int) -> None:
        """Records a firing (also call it after a forced action, so the timer restarts)."""
        self._last_time, self._last_step = self.clock(), step
