"""TrainState (what a step returns) and StepInfo (what callbacks see after a step)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.struct


@flax.struct.dataclass
class TrainState:
    """The immutable state of a run: everything exact resume needs.

    Attributes:
      step: global steps completed.
      params: the policy's trainable parameters (a pytree, e.g. an `nnx.State`).
      opt_state: the optax optimizer state.
      rng: the run's base PRNG key; per-step keys are `fold_in(rng, step)`, so no key is
        consumed statefully and a resumed run draws the same numbers.
      policy_version: optimizer updates applied so far (samples record the version that made them).
      data_position: prompts consumed by *training* (not by the prefetcher): where a resumed
        run's producer starts reading.
    """

    step: int = flax.struct.field(pytree_node=False)
    params: Any
    opt_state: Any
    rng: Any
    policy_version: int = flax.struct.field(pytree_node=False)
    data_position: int = flax.struct.field(pytree_node=False)

    def progress(self) -> dict[str, int]:
        """The integer counters, as saved next to the arrays in a checkpoint."""
        return {"step": self.step, "policy_version": self.policy_version, "data_position": self.data_position}


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What callbacks receive after each global step.

    Attributes:
      step: global steps completed (1 after the first step).
      state: the TrainState after the step.
      metrics: host floats: losses, rewards, `time/*` and `throughput/*` figures; read-only once
        callbacks see it (a callback adds metrics through `Callback.step_metrics`).
      epoch: epochs of the data source consumed so far (fractional).
      batch: the trained global batch (host/device columns), for callbacks that inspect samples.
      previous_state: the TrainState before the step, with None for the fields the update donated
        (`Trainer.donated`: its arrays were deleted by the update): the counters and rng of what
        `NaNGuard` saves when the step went non-finite (it keeps its own copy of the rest).
      is_last: the run's plan ends after this step (`max_steps` reached or the epochs' prompts used
        up: `RunInfo.is_last_step`), the one "last step" rule every callback reads. A stop asked
        by a callback or a signal is not in it (`RunInfo.control.stop_requested`).
    """

    step: int
    state: TrainState
    metrics: Mapping[str, float]
    epoch: float
    batch: Any = None
    previous_state: TrainState | None = None
    is_last: bool = False
