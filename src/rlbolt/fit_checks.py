"""What the Trainer refuses before it builds a model or compiles anything.

`check_trainer_settings` runs in the constructor (settings of the wrong kind or out of range);
`check_fit` runs first in `fit`.

Each check stops a run that would otherwise train silently wrong: micro batches that split
the groups a module computes statistics over, an algorithm that cannot learn with the plan
(a group-relative advantage with one sample per group is always 0), fewer prompts than one
step draws (the step would repeat prompts), and periodic validation without validation data.
The application layer (`rlbolt.app.build`) runs the same checks before it opens a run folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlbolt.plan import BatchPlan

MODES = ("sync", "async")


def check_trainer_settings(plan: Any, *, mode: str, master_weights: str, max_steps: int | None,
                           max_epochs: int | None, val_every_n_steps: int | None) -> None:
    """Checks the Trainer's constructor arguments that need no module or data.

    Args:
      plan: the batch plan (a `BatchPlan`).
      mode: one of `MODES`.
      master_weights: one of `rlbolt.master_weights.MODES`.
      max_steps: a positive integer or None.
      max_epochs: a positive integer or None.
      val_every_n_steps: a positive integer or None.

    Raises:
      TypeError: `plan` is not a BatchPlan.
      ValueError: a limit that is not a positive integer, or an unknown `mode` or `master_weights`.
    """
    if not isinstance(plan, BatchPlan):
        raise TypeError(f"plan must be a BatchPlan, got {type(plan).__name__}")
    for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs), ("val_every_n_steps", val_every_n_steps)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer or None")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {MODES}")
    from rlbolt import master_weights as masters  # here: importing this module needs no JAX

    if master_weights not in masters.MODES:
        raise ValueError(f"master_weights={master_weights!r}; allowed: {masters.MODES} "
                         "(auto: float32 master weights for bfloat16 params)")


def check_fit(plan: BatchPlan, module: Any, train_data: Any, val_data: Sequence | None, *,
              val_every_n_steps: int | None = None, val_at_start: bool = False,
              callbacks: Sequence[Any] = ()) -> BatchPlan:
    """Checks a fit's inputs; returns the plan with the module's whole-group stages added.

    Args:
      plan: the Trainer's batch plan.
      module: the RLModule (its `whole_groups` and `check_plan` are consulted).
      train_data: the training prompts (anything with a length).
      val_data: the validation rows, or None.
      val_every_n_steps: the Trainer's validation period, or None.
      val_at_start: the Trainer validates the starting weights (needs val_data).
      callbacks: the fit's callbacks; one whose `needs_periodic_validation` gives a reason
        (EarlyStopping on a `val/` metric) needs val_data with val_every_n_steps, or a periodic Evaluation.

    Returns:
      `plan.require_whole_groups(*module.whole_groups)`.

    Raises:
      PlanError: the plan splits groups the module needs whole, or the module cannot learn with it.
      ValueError: fewer training prompts than `prompts_per_step`, empty validation data, or
        `val_every_n_steps` or `val_at_start` without validation data, or a callback that needs periodic
        validation in a fit that does not validate periodically.
    """
    if module.whole_groups:  # the module's group statistics constrain the micro sizes
        plan = plan.require_whole_groups(*module.whole_groups)
    module.check_plan(plan)
    num_prompts = len(train_data)
    if num_prompts < plan.prompts_per_step:
        raise ValueError(
            f"train_data has {num_prompts} prompt(s), fewer than prompts_per_step={plan.prompts_per_step}: every "
            "step would repeat prompts; add rows or lower prompts_per_step")
    if val_data is not None and len(val_data) == 0:
        raise ValueError("val_data is empty; pass validation rows or val_data=None")
    if val_every_n_steps is not None and val_data is None:
        raise ValueError(f"val_every_n_steps={val_every_n_steps} but fit got no val_data, so nothing would be "
                         "validated; pass val_data=... or drop val_every_n_steps")
    if val_at_start and val_data is None:
        raise ValueError("val_at_start=True but fit got no val_data, so nothing would be validated; pass "
                         "val_data=... or val_at_start=False")
    from rlbolt.callbacks.evaluation import Evaluation  # the one validator (fit's own for val_data, or a user's)

    periodic = (val_data is not None and bool(val_every_n_steps)) or any(  # fit's own Evaluation, or a user's
        isinstance(cb, Evaluation) and cb.validates_periodically for cb in callbacks)
    for callback in callbacks:
        reason = callback.needs_periodic_validation
        if reason and not periodic:
            missing = "val_every_n_steps (fit validates only after the last step)" if val_data is not None else \
                "val_data=... and val_every_n_steps (or add an Evaluation callback)"
            raise ValueError(f"{reason}, but this fit never validates mid-run, so it would never stop early; "
                             f"pass {missing}, or monitor a step metric such as 'reward/mean'")
    return plan


def lag_steps(mode: str, max_staleness: int | None, plan: BatchPlan) -> int:
    """How many steps the producer may run ahead of training: 0 in sync mode; in async mode
    `(max_staleness + 1) // updates_per_step - 1`, which must be at least 1."""
    if mode == "sync":
        if max_staleness is not None:
            raise ValueError("max_staleness is only used with mode='async'; drop it or set mode='async'")
        return 0
    ups = plan.updates_per_step
    if max_staleness is None or (max_staleness + 1) // ups - 1 < 1:
        raise ValueError(
            f"mode='async' with max_staleness={max_staleness}: with {ups} update(s) per step the producer can run "
            f"k steps ahead only if max_staleness >= (k + 1) * {ups} - 1; use max_staleness >= {2 * ups - 1} "
            "(one step ahead) or mode='sync'"
        )
    return (max_staleness + 1) // ups - 1

