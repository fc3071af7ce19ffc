"""Evaluation: run the module's `validation_step` over an eval set every n steps / seconds and at the end.

The work is `Trainer.validate(params, eval_data, step)`: it batches the rows, calls
`validation_step`, averages the metrics (sample-weighted), prefixes them `val/` and fires
`on_validation_end` on every callback, so MetricsLogger writes them, ModelCheckpoint's
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
from rlbolt.state import StepInfo
from rlbolt.validation import accepts_keyword


class Evaluation(Callback):
    """Validates the current params on `eval_data` periodically and after the last step.

    Args:
      eval_data: validation rows (dicts with the fields `validation_step` reads).
      every_n_steps: validate when `steps completed % every_n_steps == 0`.
      every_secs: validate when this many seconds passed since the last validation.
      num_samples: k of pass@k, passed as `validation_step(..., num_samples=k)` (None: the
        module's own setting).
      at_end: also validate the final params (once, even when a periodic validation fell on that step).
      clock: seconds source for `every_secs` (injectable for tests).

    Attributes:
      history: `[(step, metrics)]` of every validation this callback ran.
    """

    order = 20  # after ModelCheckpoint recorded the step it may keep as best

    def __init__(self, eval_data: Sequence[dict], every_n_steps: int | None = None, every_secs: float | None = None,
                 num_samples: int | None = None, at_end: bool = True, clock: Callable[[], float] = time.monotonic):
        if isinstance(eval_data, (str, bytes)) or not hasattr(eval_data, "__len__") or len(eval_data) == 0:
            raise ValueError(f"Evaluation(eval_data=...) needs a non-empty sequence of row dicts, got {type(eval_data).__name__}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"Evaluation(num_samples={num_samples!r}) must be a positive integer (k of pass@k) or None")
        self.eval_data, self.num_samples, self.at_end = eval_data, num_samples, at_end
        self.every_n_steps, self.every_secs, self.clock = every_n_steps, every_secs, clock
        self.periodic = Periodic(every_n_steps, every_secs, clock)  # validates both
        self.history: list[tuple[int, dict[str, float]]] = []
        self._last_step: int | None = None

    @property
    def validates_periodically(self) -> bool:
        """True when it validates during the run (so EarlyStopping on a `val/` metric can fire)."""
        return self.every_n_steps is not None or self.every_secs is not None

    def on_fit_start(self, trainer, state) -> None:
        step = trainer.module.validation_step
        if self.num_samples is not None and not accepts_keyword(step, "num_samples"):
            raise TypeError(f"Evaluation(num_samples={self.num_samples}): {type(trainer.module).__name__}.validation_step "
                            "takes no num_samples keyword; add `*, num_samples=None` to it or leave num_samples out")
        self.periodic = Periodic(self.every_n_steps, self.every_secs, self.clock)

    def on_step_end(self, trainer, info: StepInfo) -> None:
        periodic = self.periodic.should_fire(info.step)
        if periodic or (self.at_end and _is_last_step(trainer, info)):
            self.evaluate(trainer, info.state.params, info.step)

    def on_fit_end(self, trainer, state) -> None:
        # Reached only when a callback after this one stopped the run (should_stop).
        if self.at_end and self._last_step != state.step and state.step > 0 and not trainer.interrupted:
            self.evaluate(trainer, state.params, state.step)

    def evaluate(self, trainer, params: Any, step: int) -> dict[str, float]:
        """Runs one validation pass now; returns its `val/*` metrics."""
        metrics = trainer.validate(params, self.eval_data, step, num_samples=self.num_samples)
        self.periodic.fired(step)
        self._last_step = step
        self.history.append((step, dict(metrics)))
        return metrics

    def state_dict(self) -> dict:
        return {"last_step": self._last_step}

    def load_state_dict(self, state: dict) -> None:
        self._last_step = state.get("last_step")


def _is_last_step(trainer, info: StepInfo) -> bool:
    """Whether fit ends after this step: max_steps reached, prompts for max_epochs used up (the
    producer's own rule), or an earlier callback asked to stop. A signal is not an end of run:
    an interrupted fit skips the end-of-run evaluation."""
    if trainer.stop_signal is not None:
        return False
    if trainer.should_stop:
        return True
    max_steps = trainer.max_steps
    if max_steps is not None and info.step >= max_steps:
        return True
    max_epochs, source, plan = trainer.max_epochs, trainer.source, trainer.plan
    if max_epochs is not None and source is not None and plan is not None:
        return info.state.data_position + plan.prompts_per_step > max_epochs * len(source)
    return False
