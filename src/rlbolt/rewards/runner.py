"""Failure-isolated, time-bounded reward scoring for a batch of samples.

A reward function is user code: it may raise, return NaN or a string, hang (a regex that
backtracks forever, a sandbox that never answers), hold the GIL, or end its process.
`RewardRunner.score` runs each sample's reward on a worker, gives a failed or timed-out sample
the `penalty`, counts it (`reward/failures`, `reward/timeouts`), logs each distinct failure once,
and carries on, so one bad sample never stalls or kills a training step. A sample's time-out
clock starts when a worker picks it up, so with one hung sample the call returns about
`timeout_s` after that sample started.

A reward that fails on *every* sample is a broken reward, not a hard prompt: after
`max_failed_batches` consecutive batches in which every sample failed, `score` raises
`RewardFailureError` naming the reward and its exception, instead of training on the penalty.

Executors (see `workers.py`):
- `"process"`: worker processes kept across calls; a stuck or dead one is killed and replaced,
  so `os._exit`, a GIL-holding regex or a reward that never returns costs only its sample. The
  reward must pickle and import in a fresh process (module-level functions, `functools.partial`,
  `WeightedReward` of those). Overhead: a pipe round trip per sample (benchmarks/RESULTS.md).
- `"thread"`: cheap, works with any callable, but cannot contain `os._exit` or a reward that
  holds the GIL, and cannot kill a stuck reward (its thread is abandoned; at most `max_workers`
  stuck threads, then samples fail fast).
- `"auto"` (default): `"process"`, unless the reward cannot be pickled or loaded in a worker
  (a lambda, a function defined in a notebook or `__main__`): then `"thread"`, with one warning
  that says what is lost and how to get it back.
"""

from __future__ import annotations

import logging
import math
import re
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbolt.rewards.base import RewardFn
from rlbolt.rewards.combine import WeightedReward, as_weighted
from rlbolt.rewards.workers import ProcessPool, RewardWorkerError, ThreadPool

__all__ = ["EXECUTORS", "RewardFailureError", "RewardResult", "RewardRunner"]

EXECUTORS = ("auto", "process", "thread")


class RewardFailureError(RuntimeError):
    """Every sample's reward failed in `max_failed_batches` consecutive batches."""

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


def _shutdown(holder: dict) -> None:
    pool = holder["pool"]
    for worker in holder["workers"]:
        pool.stop(worker)
    holder["workers"].clear()


class RewardRunner:
    """Scores batches with per-sample failure isolation and time-outs.

    Args:
        reward: one `RewardFn` (named after the function) or a `WeightedReward`.
        timeout_s: seconds one sample's reward may run before it gets the penalty.
        penalty: reward given to a sample whose reward raised, returned something that is not
            a finite number, timed out, or killed its worker.
        max_workers: concurrent workers (threads or processes).
        executor: `"auto"`, `"process"` or `"thread"` (see the module docstring).
        max_failed_batches: raise `RewardFailureError` after this many consecutive `score`
            calls in which every sample failed; 0 never raises.
    """

    def __init__(
        self,
        reward: RewardFn | WeightedReward,
        *,
        timeout_s: float = 10.0,
        penalty: float = 0.0,
        max_workers: int = 4,
        executor: str = "auto",
        max_failed_batches: int = 3,
    ):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"RewardRunner: timeout_s={timeout_s!r} must be a positive number of seconds")
        if not (isinstance(penalty, (int, float)) and math.isfinite(penalty)):
            raise ValueError(f"RewardRunner: penalty={penalty!r} must be a finite number")
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"RewardRunner: max_workers={max_workers!r} must be an int >= 1")
        if not (isinstance(max_failed_batches, int) and max_failed_batches >= 0):
            raise ValueError(f"RewardRunner: max_failed_batches={max_failed_batches!r} must be an int >= 0 "
                             "(0: never stop)")
        if executor not in EXECUTORS:
            raise ValueError(f"RewardRunner: executor={executor!r} must be one of {list(EXECUTORS)}")
        self.reward = as_weighted(reward)
        self.timeout_s = float(timeout_s)
        self.penalty = float(penalty)
        self.max_workers = max_workers
        self.max_failed_batches = max_failed_batches
        self._failed_batches = 0
        self._process_ready = False
        self._requested = executor
        self._pool = self._thread_pool() if executor == "thread" else None
        if self._pool is None:
            try:
                self._pool = ProcessPool(self.reward)
            except TypeError as error:  # the reward does not pickle
                if executor == "process":
                    raise
                self._fall_back(str(error))
        self._holder = {"pool": self._pool, "workers": []}
        self._logged: set[str] = set()
        self._finalizer = weakref.finalize(self, _shutdown, self._holder)

    @property
    def executor(self) -> str:
        """Where rewards run now: "process" or "thread" ("auto" resolved)."""
        return self._pool.kind

    @property
    def _workers(self) -> list:
        return self._holder["workers"]

    def live_workers(self) -> int:
        """How many worker threads or processes exist (stuck threads included)."""
        return self._pool.live()

    def _thread_pool(self) -> ThreadPool:
        return ThreadPool(self.reward, max_stuck=self.max_workers)

    def _fall_back(self, why: str) -> None:
        logger.warning(
            "reward %s runs on threads, not worker processes: a reward that calls os._exit, holds "
            "the GIL or never returns can then stop or stall the run. Define the reward at module "
            "level in an importable module for process isolation (or set reward.executor=thread "
            "to silence this). Why: %s", self.reward, why.strip().splitlines()[0])
        self._pool = self._thread_pool()
        if hasattr(self, "_holder"):
            self._holder["pool"] = self._pool

    def score(self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]) -> RewardResult:
        """Scores every (completion, sample) pair.

        Args:
            completions: N completion texts.
            samples: N prompt rows, aligned with `completions` (repeat a prompt's row for each
                completion of its group).

        Returns:
            A `RewardResult` with `[N]` arrays and scalar metrics.

        Raises:
            RewardFailureError: every sample failed, `max_failed_batches` calls in a row.
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
            for worker in [w for w in self._workers if w.ready and w not in busy]:
                if not pending:
                    break
                index = pending.popleft()
                try:
                    worker.submit(index, completions[index], samples[index])
                except Exception as error:  # e.g. an unpicklable sample row in process mode
                    errors[index] = f"could not send sample to the reward worker: {error!r}"
                    continue
                busy[worker] = (index, time.monotonic())
            booting = [w for w in self._workers if not w.ready]
            if not busy and not booting:
                while pending:  # no worker exists and none can start (stuck threads)
                    errors[pending.popleft()] = self._pool.no_worker_reason()
                continue
            deadlines = [start + self.timeout_s for _, start in busy.values()] + [w.boot_deadline for w in booting]
            for worker, kind, payload in self._pool.poll([*busy, *booting], min(deadlines) - time.monotonic()):
                if kind == "result":
                    index, ok, data = payload
                    if busy.get(worker, (None,))[0] != index:
                        continue  # late answer from an abandoned worker
                    del busy[worker]
                    if ok:
                        raw[index] = data
                    else:
                        errors[index] = self._with_names(data)
                elif kind == "died":
                    self._drop(worker)
                    if worker in busy:
                        errors[busy.pop(worker)[0]] = self._with_names(payload)
                    else:
                        self._boot_failed(payload)
                elif kind == "ready":
                    self._process_ready = True
                elif kind == "boot_error":
                    self._drop(worker)
                    self._boot_failed(payload)
            now = time.monotonic()
            for worker, (index, start) in list(busy.items()):
                if now - start >= self.timeout_s:
                    del busy[worker]
                    timeouts += 1
                    errors[index] = f"TimeoutError: {self._label()} did not return within {self.timeout_s} s"
                    self._drop(worker)
            for worker in [w for w in self._workers if not w.ready and now >= w.boot_deadline]:
                self._drop(worker)
                self._boot_failed(f"the worker did not load the reward within {self._pool.boot_timeout_s} s")
        self._fill_workers(min(self.max_workers, count))  # replacements boot while the trainer trains
        self._log(errors)
        self._check_all_failed(count, errors)
        return self._result(raw, errors, timeouts)

    def _label(self) -> str:
        names = self.reward.names
        return ("reward " if len(names) == 1 else "rewards ") + ", ".join(repr(n) for n in names)

    def _with_names(self, payload: str) -> str:
        """Worker deaths and other errors that do not say which reward get its name(s)."""
        if re.match(r"rewards? '", payload):
            return payload
        first, _, rest = payload.partition("\n")
        return f"{first} (while scoring with {self._label()})" + (f"\n{rest}" if rest else "")

    def _fill_workers(self, wanted: int) -> None:
        if not self._finalizer.alive:  # reused after close()
            self._finalizer = weakref.finalize(self, _shutdown, self._holder)
        while len(self._workers) < wanted:
            worker = self._pool.start_worker()
            if worker is None:  # the thread pool is out of room (stuck threads)
                return
            self._workers.append(worker)

    def _boot_failed(self, text: str) -> None:
        """A process worker could not load the reward: fall back to threads ("auto", before
        any worker was ready) or raise."""
        if self._requested != "auto" or self._process_ready:
            raise RewardWorkerError(
                "RewardRunner(executor='process'): the worker could not load the reward function "
                "(define rewards at module level in an importable module, not in __main__ or a "
                f"notebook, or use executor='thread'):\n{text}"
            )
        for worker in list(self._workers):
            self._drop(worker)
        self._fall_back(text.strip().splitlines()[-1])

    def _drop(self, worker) -> None:
        self._workers.remove(worker)
        self._pool.discard(worker)

    def _log(self, errors: dict[int, str]) -> None:
        for index, text in sorted(errors.items()):
            # One warning per distinct error; repeats would flood the log every step.
            key = text.strip().splitlines()[0] if text.strip() else text
            if key in self._logged:
                logger.debug("reward failed for sample %d: %s", index, key)
                continue
            self._logged.add(key)
            logger.warning(
                "reward failed for sample %d (scored %s; further identical failures are logged "
                "at debug level): %s", index, self.penalty, text,
            )
        stuck = self._pool.stuck()
        if stuck:
            logger.warning("%d abandoned reward thread(s) are still running", stuck)

    def _check_all_failed(self, count: int, errors: dict[int, str]) -> None:
        all_failed = count > 0 and len(errors) == count
        self._failed_batches = self._failed_batches + 1 if all_failed else 0
        if not self.max_failed_batches or self._failed_batches < self.max_failed_batches:
            return
        first = errors[min(errors)].strip().splitlines()[0]
        self._failed_batches = 0
        raise RewardFailureError(
            f"every sample's reward failed in {self.max_failed_batches} consecutive batches "
            f"(reward.max_failed_batches={self.max_failed_batches}), so training would only see the "
            f"penalty: {first}. Fix the reward (the first failure's traceback is in the log), or set "
            "reward.max_failed_batches=0 to train on regardless"
        )

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
        """Stops the workers (kills worker processes); stuck threads are left to exit."""
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
