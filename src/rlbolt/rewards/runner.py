"""Failure-isolated, time-bounded reward scoring for a batch of samples.

A reward function is user code: it may raise, return NaN, or hang (a regex that backtracks
forever, a sandbox that never answers). `RewardRunner.score` runs each sample's reward on a
worker, gives a failed or timed-out sample the `penalty`, counts and logs the failure, and
carries on, so one bad sample never stalls or kills a training step. A sample's time-out clock
starts when a worker picks it up, so with one hung sample the call returns about `timeout_s`
after that sample started.

Executors:
- `"thread"` (default): cheap, shares memory, works with any callable. A stuck thread cannot be
  killed; it is abandoned (a daemon thread) and a fresh worker takes its slot. A reward that
  spins inside C code while holding the GIL (e.g. a catastrophic `re` match) also freezes the
  runner's own clock: use `"process"` for such rewards.
- `"process"`: spawned worker processes kept across calls; a stuck one is killed. The reward
  must be picklable (module-level functions, `functools.partial`, `WeightedReward` of those).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbolt.rewards.base import RewardFn
from rlbolt.rewards.combine import WeightedReward, as_weighted
from rlbolt.rewards.workers import ProcessPool, ThreadPool

__all__ = ["RewardResult", "RewardRunner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardResult:
    """Scores for one batch of N samples.

    Attributes:
        rewards: `[N]` float32 weighted totals; `penalty` where the sample failed or timed out.
        per_fn: `{name: [N] float32}` raw (unweighted) score of each term; NaN where the sample
            failed or timed out.
        metrics: `reward/mean`, `reward/std` (over `rewards`), `reward/failures`,
            `reward/timeouts` (counts), and `reward/<name>/mean` over the samples that scored
            (left out when none did, so no NaN reaches the loggers).
        errors: `{sample index: error text}` for every failed or timed-out sample.
    """

    rewards: np.ndarray
    per_fn: dict[str, np.ndarray]
    metrics: dict[str, float]
    errors: dict[int, str] = field(default_factory=dict)


def _shutdown(workers: list) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


class RewardRunner:
    """Scores batches with per-sample failure isolation and time-outs.

    Args:
        reward: one `RewardFn` (named after the function) or a `WeightedReward`.
        timeout_s: seconds one sample's reward may run before it gets the penalty.
        penalty: reward given to a sample whose reward raised, returned a non-finite value,
            or timed out.
        max_workers: concurrent workers (threads or processes).
        executor: `"thread"` or `"process"` (see the module docstring).
        mp_context: start method for `executor="process"`: `"spawn"` or `"forkserver"`.
    """

    def __init__(
        self,
        reward: RewardFn | WeightedReward,
        *,
        timeout_s: float = 10.0,
        penalty: float = 0.0,
        max_workers: int = 4,
        executor: str = "thread",
        mp_context: str = "spawn",
    ):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"RewardRunner: timeout_s={timeout_s!r} must be a positive number of seconds")
        if not (isinstance(penalty, (int, float)) and math.isfinite(penalty)):
            raise ValueError(f"RewardRunner: penalty={penalty!r} must be a finite number")
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"RewardRunner: max_workers={max_workers!r} must be an int >= 1")
        self.reward = as_weighted(reward)
        self.timeout_s = float(timeout_s)
        self.penalty = float(penalty)
        self.max_workers = max_workers
        if executor == "thread":
            self._pool = ThreadPool(self.reward)
        elif executor == "process":
            self._pool = ProcessPool(self.reward, mp_context)
        else:
            raise ValueError(f"RewardRunner: executor={executor!r} must be 'thread' or 'process'")
        self.executor = executor
        self._workers: list = []
        self._logged: set[str] = set()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def score(self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]) -> RewardResult:
        """Scores every (completion, sample) pair.

        Args:
            completions: N completion texts.
            samples: N prompt rows, aligned with `completions` (repeat a prompt's row for each
                completion of its group).

        Returns:
            A `RewardResult` with `[N]` arrays and scalar metrics.
        """
        if len(completions) != len(samples):
            raise ValueError(
                f"RewardRunner.score: got {len(completions)} completions but {len(samples)} samples; "
                "pass one sample row per completion"
            )
        count = len(completions)
        raw: list[dict[str, float] | None] = [None] * count
        errors: dict[int, str] = {}
        timeouts = 0
        pending = deque(range(count))
        busy: dict[Any, tuple[int, float]] = {}  # worker -> (sample index, start time)
        while pending or busy:
            self._fill_workers(min(self.max_workers, len(pending) + len(busy)))
            for worker in [w for w in self._workers if w not in busy]:
                if not pending:
                    break
                index = pending.popleft()
                try:
                    worker.submit(index, completions[index], samples[index])
                except Exception as error:  # e.g. an unpicklable sample row in process mode
                    errors[index] = f"could not send sample to the reward worker: {error!r}"
                    continue
                busy[worker] = (index, time.monotonic())
            if not busy:
                continue
            wait_s = min(start for _, start in busy.values()) + self.timeout_s - time.monotonic()
            for worker, index, ok, payload in self._pool.poll([(w, i) for w, (i, _) in busy.items()], wait_s):
                if busy.get(worker, (None,))[0] != index:
                    continue  # late answer from an abandoned worker
                del busy[worker]
                if ok:
                    raw[index] = payload
                else:
                    errors[index] = payload
                if worker.dead:
                    self._drop(worker)
            now = time.monotonic()
            for worker, (index, start) in list(busy.items()):
                if now - start >= self.timeout_s:
                    del busy[worker]
                    timeouts += 1
                    errors[index] = f"TimeoutError: reward did not return within {self.timeout_s} s"
                    self._drop(worker)
        self._log(errors, raw)
        return self._result(raw, errors, timeouts)

    def _fill_workers(self, wanted: int) -> None:
        if not self._finalizer.alive:  # reused after close()
            self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        while len(self._workers) < wanted:
            self._workers.append(self._pool.start_worker())

    def _drop(self, worker) -> None:
        self._workers.remove(worker)
        self._pool.discard(worker)

    def _log(self, errors: dict[int, str], raw: list) -> None:
        for index, text in sorted(errors.items()):
            # One warning per distinct error; repeats would flood the log every step.
            key = text.strip().splitlines()[-1] if text.strip() else text
            if key in self._logged:
                logger.debug("reward failed for sample %d: %s", index, key)
                continue
            self._logged.add(key)
            logger.warning(
                "reward failed for sample %d (scored %s; further identical failures are logged "
                "at debug level): %s", index, self.penalty, text,
            )
        stuck = self._pool.still_stuck()
        if stuck:
            logger.warning("%d abandoned reward thread(s) are still running", stuck)

    def _result(self, raw: list, errors: dict[int, str], timeouts: int) -> RewardResult:
        count = len(raw)
        rewards = np.full((count,), self.penalty, dtype=np.float64)
        per_fn = {name: np.full((count,), np.nan, dtype=np.float32) for name in self.reward.names}
        for index, scores in enumerate(raw):
            if scores is None or index in errors:
                continue
            rewards[index] = self.reward.combine(scores)
            for name, value in scores.items():
                per_fn[name][index] = value
        rewards32 = rewards.astype(np.float32)
        metrics = {
            "reward/mean": float(rewards.mean()) if count else 0.0,
            "reward/std": float(rewards.std()) if count else 0.0,
            "reward/failures": float(len(errors) - timeouts),
            "reward/timeouts": float(timeouts),
        }
        for name, values in per_fn.items():
            scored = values[~np.isnan(values)]
            if scored.size:
                metrics[f"reward/{name}/mean"] = float(scored.astype(np.float64).mean())
        return RewardResult(rewards=rewards32, per_fn=per_fn, metrics=metrics, errors=dict(errors))

    def close(self) -> None:
        """Stops the workers (kills worker processes); abandoned threads are left to exit."""
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
