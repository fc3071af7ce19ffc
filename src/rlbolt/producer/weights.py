"""WeightStore: the policy weights the producer may roll out with, keyed by steps completed.

The trainer publishes the parameters after each global step; the producer asks for the weights
"after n steps" and blocks until they exist. Sync mode produces step s (0-based) with the weights
after s steps, i.e. the latest (on-policy); async mode uses those after s - lag steps, so it runs
`lag` steps ahead. Because the producer always takes exactly those weights, async runs are deterministic
and resume exactly: the retained weights are part of the checkpoint.

With roles on their own devices (`rlbolt.distributed.placement`), `transfer` makes the rollout's
copy of each published set once (a reshard onto the rollout mesh; across processes the push to
the rollout group, which returns None); `get(..., rollout=True)` returns it, while the logps
stage and checkpoints use the training copy. `feed_ahead` (across process groups: 0) makes
`get` for step s also wait until the weights after s - feed_ahead steps are published, so the
training group's producer does not run ahead of its own update (the rollout group does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rlbolt.producer.stage_threads import StageThreads


def weights_for_step(step: int, lag_steps: int) -> int:
    """Which weights produce step `step` (0-based): those after `max(0, step - lag_steps)` steps."""
    return max(0, step - lag_steps)


class WeightStore:
    """Thread-safe map: steps completed -> params (keeps only what the producer still needs)."""

    def __init__(self, lag_steps: int = 0, transfer: Callable[[Any, int, int], Any] | None = None):
        self.lag_steps = lag_steps
        # (params, policy_version, steps_completed) -> the rollout's copy (None: the same arrays)
        self.transfer = transfer
        self.feed_ahead: int | None = None  # get(step) also waits for the weights after step - feed_ahead steps
        self._cond = threading.Condition()
        self._weights: dict[int, Any] = {}
        self._newest = -1  # the most steps completed of any published weights

    def publish(self, steps_completed: int, params: Any, policy_version: int) -> None:
        rollout = params if self.transfer is None else self.transfer(params, policy_version, steps_completed)  # not awaited
        with self._cond:
            self._weights[steps_completed] = (params, policy_version, rollout)
            self._newest = max(self._newest, steps_completed)
            # The producer of step s needs key max(0, s - lag); the next step to produce is at
            # least steps_completed, so older keys can go.
            keep_from = max(0, steps_completed - self.lag_steps)
            for key in [k for k in self._weights if k < keep_from]:
                del self._weights[key]
            self._cond.notify_all()

    def key_for_step(self, step: int) -> int:
        """Which weights produce step `step` (0-based): those after step - lag steps."""
        return weights_for_step(step, self.lag_steps)

    def get(self, step: int, stop_event: threading.Event, *, rollout: bool = False) -> tuple[Any, int]:
        """Blocks until the weights that produce `step` are published; returns (params, version):
        the training copy, or with `rollout` the rollout's copy (the same arrays when colocated)."""
        key = self.key_for_step(step)
        newest = key if self.feed_ahead is None else max(key, step - self.feed_ahead)
        StageThreads.wait(lambda: key in self._weights and self._newest >= newest, stop_event, self._cond)
        with self._cond:
            params, version, copy = self._weights[key]
        return (copy if rollout else params), version

    def retained(self) -> dict[int, tuple[Any, int]]:
        """{steps completed: (params, policy_version)} held now (checkpointed so async runs resume exactly)."""
        with self._cond:
            return {k: (params, version) for k, (params, version, _) in self._weights.items()}
