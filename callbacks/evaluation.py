"""Evaluation: the one validator. Runs the module's `validation_step` over an eval set every n steps /
seconds, after the last step and (optionally) before the first.

`Trainer.fit(val_data=...)` installs one (`Evaluation.of_fit`: the Trainer's `val_every_n_steps`
and `val_at_start`, ordered after every other callback); a user adds more for other eval sets.
The work is `run.control.validate(params, eval_data, step)` (`Trainer.validate`): it batches the
rows, calls `validation_step`, averages the metrics (sample-weighted), prefixes them `val/` and
fires `on_validation_end` on every callback, so MetricsLogger writes them, ModelCheckpoint's
`best_metric="val/..."` keeps the best step and EarlyStopping can watch them.

pass@k: the number of samples per prompt is the module's business (LMPolicyModule reads
`rollout.val_num_samples`). `Evaluation(num_samples=k)` passes it as an argument,
`validation_step(params, batch, num_samples=k)`; a module whose `validation_step` takes no
`num_samples` keyword is refused when the fit starts.

Ordering: `order = 20` runs it after ModelCheckpoint (whose `best_metric` save needs the step's
state, recorded in its own `on_step_end`) whatever the list order. A user callback with an order
above 20 that stops the run gets the final evaluation in `on_fit_end`, after MetricsLogger closed
its writers: give such a callback an order below 20.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from rlbolt.callback import Callback, Periodic
from rlbolt.run_info import RunInfo
from rlbolt.state import StepInfo
from rlbolt.validation import accepts_keyword

AFTER_ALL = 1_000_000  # the order of the Evaluation `fit(val_data=...)` installs: after every other callback
FIT_VALIDATION = "Evaluation/fit"  # its state_key


class Evaluation(Callback):
    """Validates the current params on `eval_data` periodically and after the last step.

    Args:
      eval_data: validation rows (dicts with the fields `validation_step` reads).
      every_n_steps: validate when `steps completed % every_n_steps == 0`.
      every_secs: validate when this many seconds passed since the last validation.
      num_samples: k of pass@k, passed as `validation_step(..., num_samples=k)` (None: the
        module's own setting).
      at_end: also validate the final params (once, even when a periodic validation fell on that step).
      at_start: also validate the starting params before the first step (logged at step 0; not on
        a resume): the "before" of a before/after comparison.
      clock: seconds source for `every_secs` (injectable for tests).

    Attributes:
      history: `[(step, metrics)]` of every validation this callback ran.
    """

    order = 20  # after ModelCheckpoint recorded the step it may keep as best

    def __init__(self, eval_data: Sequence[dict], every_n_steps: int | None = None, every_secs: float | None = None,
                 num_samples: int | None = None, at_end: bool = True, at_start: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(eval_data, (str, bytes)) or not hasattr(eval_data, "__len__") or len(eval_data) == 0:
            raise ValueError(f"Evaluation(eval_data=...) needs a non-empty sequence of row dicts, got {type(eval_data).__name__}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"Evaluation(num_samples={num_samples!r}) must be a positive integer (k of pass@k) or None")
        self.eval_data, self.num_samples, self.at_end, self.at_start = eval_data, num_samples, at_end, bool(at_start)
        self.every_n_steps, self.every_secs, self.clock = every_n_steps, every_secs, clock
        self.periodic = Periodic(every_n_steps, every_secs, clock)  # validates both
        self.history: list[tuple[int, dict[str, float]]] = []
        self._last_step: int | None = None
        self._key = type(self).__name__

    @classmethod
    def of_fit(cls, val_data: Sequence[dict], every_n_steps: int | None, at_start: bool) -> Evaluation:
        """The validation `Trainer.fit(val_data=...)` installs: run after every other callback's hooks,
        checkpointed under its own key ("Evaluation/fit") beside a user's Evaluation."""
        evaluation = cls(val_data, every_n_steps=every_n_steps, at_start=at_start)
        evaluation.order, evaluation._key = AFTER_ALL, FIT_VALIDATION
        return evaluation

    @property
    def state_key(self) -> str:
        """The name its state is checkpointed under ("Evaluation"; "Evaluation/fit" for fit's own)."""
        return self._key

    @property
    def validates_periodically(self) -> bool:
        """True when it validates during the run (so EarlyStopping on a `val/` metric can fire)."""
        return self.every_n_steps is not None or self.every_secs is not None

    def on_fit_start(self, run: RunInfo, state) -> None:
        step = run.module.validation_step
        if self.num_samples is not None and not accepts_keyword(step, "num_samples"):
            raise TypeError(f"Evaluation(num_samples={self.num_samples}): {type(run.module).__name__}.validation_step "
                            "takes no num_samples keyword; add `*, num_samples=None` to it or leave num_samples out")
        self.periodic = Periodic(self.every_n_steps, self.every_secs, self.clock)
        if self.at_start and state.step == 0:
            self.evaluate(run, state.params, 0)

    def on_step_end(self, run: RunInfo, info: StepInfo) -> None:
        periodic = self.periodic.should_fire(info.step)
        if periodic or (self.at_end and _ends_here(run, info)):
            self.evaluate(run, info.state.params, info.step)

    def on_fit_end(self, run: RunInfo, state) -> None:
        # Reached only when a callback after this one stopped the run (request_stop).
        if self.at_end and self._last_step != state.step and state.step > 0 and not run.control.interrupted:
            self.evaluate(run, state.params, state.step)

    def evaluate(self, run: RunInfo, params: Any, step: int) -> dict[str, float]:
        """Runs one validation pass now; returns its `val/*` metrics."""
        metrics = run.control.validate(params, self.eval_data, step, num_samples=self.num_samples)
        self.periodic.fired(step)
        self._last_step = step
        self.history.append((step, dict(metrics)))
        return metrics

    def state_dict(self) -> dict:
        return {"last_step": self._last_step}

    def load_state_dict(self, state: dict) -> None:
        self._last_step = state.get("last_step")


def _ends_here(run: RunInfo, info: StepInfo) -> bool:
    """Whether fit ends after this step: the plan's last step (`info.is_last`) or an earlier
    callback asked to stop. A signal is not an end of run: an interrupted fit skips the
    end-of-run evaluation."""
    if run.control.stop_signal is not None:
        return False
    return info.is_last or run.control.stop_requested
