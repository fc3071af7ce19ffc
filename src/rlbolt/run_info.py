"""What a callback sees of a fit: a frozen `RunInfo`, a `Control` to ask the run for things, and
the `Restore` an `on_restore` hook returns for the Trainer to apply.

Callbacks never receive the Trainer: they read the run's description (`RunInfo`), the step's
(`StepInfo`, `rlbolt.state`) and act through `RunInfo.control` (stop the run, validate now).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class Control:
    """What a callback may ask of the run, and what it may read of the run's progress.

    Args:
      validate: `(params, rows, step, *, num_samples=None) -> val/* metrics`: one validation pass
        whose metrics every callback then receives in `on_validation_end` (None: the run cannot
        validate, e.g. a callback driven by hand in a test).
    """

    def __init__(self, validate: Callable[..., dict[str, float]] | None = None):
        self._validate = validate
        self._stop = False
        self.interrupted = False  # the fit was stopped by SIGINT/SIGTERM or a KeyboardInterrupt
        self.stop_signal: int | None = None  # the signal that asks the run to stop, once one arrived

    def request_stop(self) -> None:
        """Ends the fit after the current step, with the usual end-of-fit hooks (final checkpoint, logs)."""
        self._stop = True

    def stop_on_signal(self, signum: int) -> None:
        """A deferred SIGINT/SIGTERM (`rlbolt.signals.StopOnSignal`): stop after this step, keeping the signal."""
        self.stop_signal = signum
        self.request_stop()

    @property
    def stop_requested(self) -> bool:
        """Whether a callback or a signal asked the run to stop after the current step (setting it
        True is `request_stop()`; a stop cannot be taken back: each fit gets a fresh Control)."""
        return self._stop

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        if not value:
            raise ValueError("a stop cannot be taken back; fit starts each run with a fresh Control")
        self.request_stop()

    def validate(self, params: Any, rows: Sequence[dict], step: int, *,
                 num_samples: int | None = None) -> dict[str, float]:
        """Runs the module's `validation_step` over `rows` now and reports the metrics to every
        callback (`on_validation_end`).

        Args:
          params: the parameters to validate.
          rows: the validation rows.
          step: the global step just completed.
          num_samples: k of pass@k, passed as `validation_step(..., num_samples=k)` (None: not passed).

        Returns:
          The `val/*` means (sample-weighted over every process's rows).
        """
        if self._validate is None:
            raise RuntimeError("this run cannot validate (its Control was built without a validate function)")
        return self._validate(params, rows, step, num_samples=num_samples)


class ControlField:
    """An attribute that lives on its owner's `control` (a `Control`): the Trainer's `should_stop`
    (`Control.stop_requested`), `interrupted` and `stop_signal`, kept on the run's Control (a fresh
    one each fit) so the Trainer, the signal handler and the callbacks read one value.

    Args:
      name: the Control's attribute (None: the same name as this one's).
    """

    def __init__(self, name: str | None = None):
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.control, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.control, self.name, value)


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """The frozen description of a fit that every callback hook receives first.

    Attributes:
      run_dir: where callbacks write (metrics, checkpoints).
      plan: the run's BatchPlan.
      mode: "sync" or "async".
      lag_steps: how many steps the producer runs ahead of training (0 in sync mode).
      max_steps: the step limit (None: the epochs bound the run).
      max_epochs: the epoch limit (None: the steps bound the run).
      total_steps: the steps the run will take (`max_steps`, else the prompts of `max_epochs`
        over `prompts_per_step`), None when unknown.
      max_prompts: training prompts the run may consume (`max_epochs` x the source's length; None: unbounded).
      is_main_process: whether this process writes files (process 0).
      card: the module's description (`RLModule.card()`): model config, policy params, export,
        tokenizer, learning-rate schedule, hparams; None for a module without a language model.
      module: the RLModule being trained (callbacks call its declared hooks, e.g. `validation_step`).
      settings: the Trainer's settings as a checkpoint and a dashboard record them (seed, mode, limits...).
      donated: the TrainState fields each update donates (their arrays are deleted by the update).
      control: stop the run, validate now, read whether the run was interrupted.
      timeline: the run's stage events (`rlbolt.timeline.Timeline`), drained by TimelineLogger.
      callbacks: every callback of the fit, in dispatch order (e.g. NaNGuard saves through the ModelCheckpoint).
      retained_weights: `() -> {step: (params, policy_version)}`: the published weights the producer
        may still roll out with (a checkpoint saves those a resumed async run needs).
      callback_states: `() -> {state_key: state_dict}` of every callback (saved in each checkpoint).
    """

    run_dir: Path
    plan: Any = None
    mode: str = "sync"
    lag_steps: int = 0
    max_steps: int | None = None
    max_epochs: int | None = None
    total_steps: int | None = None
    max_prompts: int | None = None
    is_main_process: bool = True
    card: Any = None
    module: Any = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    donated: tuple[str, ...] = ()
    control: Control = dataclasses.field(default_factory=Control)
    timeline: Any = None
    callbacks: tuple = ()
    retained_weights: Callable[[], Mapping[int, tuple[Any, int]]] = dict
    callback_states: Callable[[], dict] = dict

    def is_last_step(self, step: int, data_position: int) -> bool:
        """Whether the run's plan ends after `step` (steps completed): `max_steps` reached, or too few
        prompts left for another step (the producer's own rule). The one "last step" rule:
        `StepInfo.is_last` holds it."""
        if self.max_steps is not None and step >= self.max_steps:
            return True
        per_step = getattr(self.plan, "prompts_per_step", None)
        return self.max_prompts is not None and per_step is not None and data_position + per_step > self.max_prompts


@dataclasses.dataclass(frozen=True)
class Restore:
    """What an `on_restore` hook returns for the Trainer to apply (a resume).

    Attributes:
      state: the restored TrainState (later callbacks' `on_restore` and every `on_fit_start` see it).
      callback_states: `{state_key: state_dict}` to load into the callbacks (None: none).
      weights: `{step: (params, policy_version)}` to publish for the producer (an async run's
        retained weights), published oldest first.
    """

    state: Any
    callback_states: Mapping[str, dict] | None = None
    weights: Mapping[int, tuple[Any, int]] = dataclasses.field(default_factory=dict)

    def apply(self, callbacks: Any, weights: Any) -> Any:
        """Loads every callback's state and publishes the retained weights, oldest first (a publish
        prunes the keys older than its own minus the lag); returns the state to start from.

        Args:
          callbacks: the fit's `CallbackList` (its `load_state_dict`).
          weights: the fit's `WeightStore` (its `publish`).
        """
        callbacks.load_state_dict(dict(self.callback_states or {}))
        for k in sorted(self.weights):
            params, version = self.weights[k]
            weights.publish(k, params, version)
        return self.state


def total_steps(max_steps: int | None, max_prompts: int | None, prompts_per_step: int) -> int | None:
    """Steps a run will take: `max_steps`, else the prompts it may consume over `prompts_per_step`
    (at least 1); None when neither bounds it."""
    if max_steps:
        return max_steps
    if max_prompts:
        return max(1, max_prompts // prompts_per_step)
    return None
