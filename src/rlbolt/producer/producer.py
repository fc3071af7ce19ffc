"""The producer: stage threads around an ExperienceDock, each pulling at its own dispatch size.

    feeder     per step: the weights for the step, this process's share of the prompts (all
               of them on one process) repeated G times (a a b b) with group_ids,
               policy_version, prompt_index, sample_keys -> dock.add(key=step);
               refill rounds (DAPO) join the same step
    rollout    dock.get("rollout",   n=rollout_micro_batch_size) -> on_rollout    -> dock.put
    logps      dock.get("logps",     n=logps_micro_batch_size)   -> compute_logps -> dock.put
    reward     dock.get("reward",    n=reward_micro_batch_size)  -> on_reward     -> dock.put
               (only for a module that overrides on_reward, on one data share)
    advantage  dock.get("advantage", the whole round, whole groups) -> [several processes:
               gather the shares, so every process holds the whole round] -> on_advantage;
               when the step is full: put rewards/advantages of the kept samples, discard the
               rest (several processes: add the kept rows of the whole step for "train" only);
               else ask the feeder for a refill round
    train      the consumer (the Trainer's thread): dock.get("train", n=global batch) -> ProducedStep

Each stage takes the oldest step's samples first (`one_batch`), so a dispatch never mixes
steps (their weights differ) or rounds, and its last dispatch of a round may be short. Stages
hand over as soon as their inputs are ready: the logps of the first rollout micro batch run
while the second is generated, and the lcm of the micro sizes (the plan's service batch) is
simply where the stages' dispatches line up again. Every sample's result depends only on its
own key, its step's weights and the dispatch it was in, which are those of the sequential
producer, so the results are the same bit for bit (tests/core/test_producer_equivalence.py).

Several processes (`share`): each rolls out its share of every round at 1/size of each micro
size, and the advantage stage gathers the shares, one collective per round, in round order on
every process. A jitted call on a mesh that spans processes is a collective too, and every
process must issue them in one order, so with several processes the logps stage takes a whole
round once it is rolled out (then runs it in logps micro batches): rollout and logps take turns
instead of overlapping, the order is that of the sequential producer, and the reward stage
folds into on_advantage (`score_shared` scores each share's rows and agrees on a failure).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from rlbolt.batch import STAGE_SCHEMAS, Batch, check_stage
from rlbolt.data.source import PromptSource
from rlbolt.distributed.sharding import DataShare
from rlbolt.producer.dock import DockClosed, ExperienceDock
from rlbolt.producer.prompt_rows import prompt_batch, sample_keys  # noqa: F401 - sample_keys: its old home
from rlbolt.producer.handoff import INDEX_COLUMN, added_columns, gather_round, kept_samples, step_rows, with_rewards
from rlbolt.module import RLModule, collect_log_values, mean_logs
from rlbolt.plan import BatchPlan
from rlbolt.producer.stage_threads import _POLL_S, ProducerStopped, StageThreads
from rlbolt.timeline import Timeline
from rlbolt.utils.xla_flags import release_freed_host_memory
from rlbolt.producer.weights import WeightStore

# The columns a sample needs before each stage may take it ("reward" runs only for a module
# that overrides on_reward; "advantage" then also waits for its rewards).
STAGE_INPUTS = {
    "rollout": ("sample_keys", "group_ids", "policy_version", "prompt_index"),
    "logps": tuple(STAGE_SCHEMAS["rollout"]),
    "reward": tuple(STAGE_SCHEMAS["logps"]),
    "advantage": tuple(STAGE_SCHEMAS["logps"]),
    "train": tuple(STAGE_SCHEMAS["advantage"]),
}
# What runs each stage, in placement terms (a placement maps roles to devices).
STAGE_ROLES = {"rollout": "rollout", "logps": "train", "reward": "host", "advantage": "host", "update": "train",
               "validate": "rollout"}
_TIMES = {"rollout": "time/rollout", "logps": "time/logps", "reward": "time/reward", "advantage": "time/reward"}


@dataclasses.dataclass
class ProducedStep:
    """One global step's experience, as the consumer receives it.

    Attributes:
      step: 0-based index of the global step this batch is for.
      batch: the global batch, checked against the "advantage" stage schema.
      data_position: the prompt counter after this step's prompts (refills included).
      weights_step: the weights used were those after this many steps.
      policy_version: the policy version of those weights.
      metrics: what the producer measured (time/rollout, time/logps, time/reward, the dock's
        time/dock_wait/<stage>, refills, RLModule.log values); `rlbolt.step_metrics` joins them
        with the batch's and the update's.
    """

    step: int
    batch: Batch
    data_position: int
    weights_step: int
    policy_version: int
    metrics: dict[str, float]


@dataclasses.dataclass
class _Step:
    """What the stages know about one step in flight (each field has one writing thread)."""

    params: Any
    version: int
    rollout_params: Any = None  # the rollout's copy (the same arrays when colocated)
    step: int = 0
    position: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # stage -> seconds in its hook
    logs: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    rounds: list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]] = dataclasses.field(default_factory=list)
    gathered: list[tuple[np.ndarray, Batch]] = dataclasses.field(default_factory=list)  # shares: (dock idx, round)
    decisions: queue.Queue = dataclasses.field(default_factory=queue.Queue)  # advantage -> feeder

    def note(self, stage: str, seconds: float, logged: dict[str, list[float]]) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds  # a key per stage: one writing thread
        for name, values in logged.items():
            self.logs.setdefault(stage, {}).setdefault(name, []).extend(values)

    def times(self) -> dict[str, float]:
        out = dict.fromkeys(_TIMES.values(), 0.0)
        for stage, seconds in self.seconds.items():
            out[_TIMES[stage]] += seconds
        return out


class Producer:
    """Makes `ProducedStep`s in order from a start step and data position, on stage threads.

    Args:
      module: the RLModule whose producer hooks run (on_rollout, compute_logps, on_advantage).
      plan: the batch sizes; each stage pulls at its micro size.
      source: the prompts.
      weights: the WeightStore the feeder takes each step's weights from (it bounds how far
        the producer runs ahead).
      base_rng: the run's key; sample keys are derived from it, the step and the sample.
      max_steps: steps to produce (None: until the prompts run out).
      max_prompts: prompt counter limit (max_epochs x prompts), or None.
      timeline: where stage events go (None: a private one).
      share: this process's `DataShare` of every step's prompts (None: one process, all of
        them). Sample keys come from the global sample index, so a sample does not depend on
        which process made it; every process trains on the same whole global batch.
      rollout: replaces the rollout stage's `on_rollout` call: `(step, batch) -> batch with the
        rollout columns` (a rollout made by another process group: `rlbolt.producer.remote_rollout`).
      decided: with refill rounds, told each of a step's decisions after a round: `(step, round,
        missing samples)`, 0 when the step is full (the rollout group makes the refills:
        `RemoteRollout.decided`).
    """

    def __init__(self, module: RLModule, plan: BatchPlan, source: PromptSource, weights: WeightStore,
                 base_rng: jax.Array, *, max_steps: int | None, max_prompts: int | None,
                 timeline: Timeline | None = None, share: DataShare | None = None,
                 rollout: Callable[[int, Batch], Batch] | None = None,
                 decided: Callable[[int, int, int], None] | None = None):
        self.module, self.plan, self.source, self.weights = module, plan, source, weights
        self.decided = decided
        self.base_rng, self.max_steps, self.max_prompts = base_rng, max_steps, max_prompts
        self.timeline = timeline if timeline is not None else Timeline()
        self.share = share or DataShare()
        self.rollout = rollout

    def start(self, start_step: int, start_position: int, *, timeout_s: float | None = None,
              should_stop: Callable[[], bool] | None = None) -> "_Run":
        """Starts the stage threads; use as `with producer.start(...) as steps: for produced in steps`.

        Args:
          start_step: the first step to produce.
          start_position: the prompt counter to start reading at.
          timeout_s: the consumer raises TimeoutError when no step arrives for this long.
          should_stop: polled while the consumer waits for a step; True ends the iteration as if
            the data had run out (a stop request while no step is running takes effect at once).
        """
        return _Run(self, start_step, start_position, timeout_s, should_stop or (lambda: False))


class _Run:
    """One running pipeline: the dock, the steps in flight, the stage threads."""

    def __init__(self, producer: Producer, start_step: int, start_position: int, timeout_s: float | None,
                 should_stop: Callable[[], bool]):
        self.p, self.start_step, self.start_position, self.timeout_s = producer, start_step, start_position, timeout_s
        self.should_stop = should_stop
        self.parts = producer.share.size  # data shares: each stage's dispatch is 1/parts of the plan's
        self.serial = jax.process_count() > 1  # device stages take turns (collectives in one order)
        self.rewards = type(producer.module).on_reward is not RLModule.on_reward and self.parts == 1  # a reward stage
        stages = dict(STAGE_INPUTS)
        if self.rewards:
            stages["advantage"] += ("rewards",)
        else:
            del stages["reward"]
        self.dock = ExperienceDock(stages)
        self.steps: dict[int, _Step] = {}
        self.threads = StageThreads(self.dock.close, quiet=(DockClosed,))

    def __enter__(self) -> "_Run":
        plan, module, parts = self.p.plan, self.p.module, self.parts
        self.threads.start("feeder", self._feed)
        remote = self.p.rollout
        self.threads.start("rollout", lambda stop: self._stage(
            "rollout", plan.rollout_micro_batch_size // parts,
            lambda s, b: check_stage(module.on_rollout(s.rollout_params, b) if remote is None else remote(s.step, b),
                                     "rollout")))
        self.threads.start("logps", lambda stop: self._stage(
            "logps", plan.logps_micro_batch_size // parts,
            lambda s, b: check_stage(module.compute_logps(s.params, b), "logps"), whole_round=self.serial))
        if self.rewards:
            self.threads.start("reward", lambda stop: self._stage(
                "reward", plan.reward_micro_batch_size, lambda s, b: with_rewards(module.on_reward(b))))
        self.threads.start("advantage", self._advantage)
        self._steps = self._consume()
        return self

    def __iter__(self) -> Iterator[ProducedStep]:
        return self._steps

    def __exit__(self, *exc_info) -> None:
        if not self.threads.stopped:
            self.threads.stop()

    def request_stop(self) -> None:
        """Asks every stage to stop and wakes them; returns at once (see `stop` to join)."""
        self.threads.request_stop()

    def stop(self, join_timeout_s: float = 10.0, *, strict: bool = True) -> bool:
        """Stops and joins the stage threads (`StageThreads.stop`); True when all have ended."""
        return self.threads.stop(join_timeout_s, strict=strict)

    # -- the stages ------------------------------------------------------------------------------
    def _feed(self, stop: threading.Event) -> None:
        p, plan = self.p, self.p.plan
        step, position = self.start_step, self.start_position
        while p.max_steps is None or step < p.max_steps:
            if p.max_prompts is not None and position + plan.prompts_per_step > p.max_prompts:
                break  # max_epochs reached: not enough prompts left for a full step
            params, version = p.weights.get(step, stop)
            rollout_params, _ = p.weights.get(step, stop, rollout=True)
            if step == self.start_step + 1:  # in sync mode the first step's compilations are over
                release_freed_host_memory()
            record = self.steps[step] = _Step(params, version, rollout_params, step)
            prompts, round_index, parts = plan.prompts_per_step, 0, self.parts
            while True:
                prompts = -(-prompts // parts) * parts  # equal shares
                batch = self._prompt_batch(step, round_index, position, prompts, version)
                position += prompts
                record.position = position
                self.dock.add(batch, key=step)
                if not plan.max_refill_rounds and parts == 1:  # shares: wait for the step's train rows before finish()
                    break
                missing = _wait_for(record.decisions, stop)
                if plan.max_refill_rounds and p.decided is not None:
                    p.decided(step, round_index, missing)
                if not missing:
                    break
                round_index, prompts = round_index + 1, -(-missing // plan.num_generations)
            step += 1
        self.dock.finish()

    def _prompt_batch(self, step: int, round_index: int, position: int, prompts: int, version: int) -> Batch:
        p = self.p
        return prompt_batch(p.source, p.share, p.base_rng, p.plan.num_generations, step, round_index, position,
                            prompts, version)

    def _stage(self, stage: str, size: int, hook, whole_round: bool = False) -> None:
        """rollout / logps / reward: take `size` samples of the oldest step (whole_round: the
        whole round once it is ready, run in `size` pieces), run the hook, write what it added."""
        while True:
            taken = self.dock.get(stage, n=None if whole_round else size, one_batch=True)
            if not len(taken.indices):
                return  # the feeder finished and every step went through
            step = taken.keys[0]
            record = self.steps[step]
            for lo in range(0, len(taken.indices), size):
                batch, idx = taken if len(taken.indices) <= size else (taken.batch.slice(lo, lo + size),
                                                                     taken.indices[lo:lo + size])
                out, seconds, logged = self._timed(stage, step, len(idx), lambda: hook(record, batch))
                added = added_columns(stage, batch, out, np.arange(len(idx)))
                record.note(stage, seconds, logged)  # before the put: the step may complete right after
                self.dock.put(added, idx)

    def _advantage(self, stop: threading.Event) -> None:
        plan, want = self.p.plan, self.p.plan.global_batch_size
        while True:
            taken = self.dock.get("advantage", one_batch=True, whole_groups=True)  # a whole round
            batch, idx = taken
            if not len(idx):
                return
            step = taken.keys[0]
            record = self.steps[step]
            if self.parts > 1:  # every process now holds the whole round; ids are its positions
                batch = gather_round(batch, self.p.share)
                record.gathered.append((idx, batch))
                idx = np.arange(batch.num_samples, dtype=np.int64)
            hook = lambda: check_stage(self.p.module.on_advantage(batch.with_columns({INDEX_COLUMN: idx})), "advantage")
            out, seconds, logged = self._timed("advantage", step, len(idx), hook)
            kept, positions = kept_samples(out, idx)
            record.rounds.append((idx, kept, added_columns("advantage", batch, out.drop(INDEX_COLUMN), positions)))
            record.note("advantage", seconds, logged)
            total = sum(len(k) for _, k, _ in record.rounds)
            if total >= want:
                self._complete(step, record, want)
            elif len(record.rounds) <= plan.max_refill_rounds:
                record.decisions.put(want - total)
            else:
                raise RuntimeError(
                    f"step {step}: on_advantage kept {total} of {want} samples after {plan.max_refill_rounds} refill "
                    "round(s) (max_refill_rounds); raise max_refill_rounds or make the module keep more samples")

    def _complete(self, step: int, record: _Step, want: int) -> None:
        """The step is full: its first `want` kept samples get their columns, the rest are dropped."""
        budget, writes, dropped = want, [], []
        for idx, kept, columns in record.rounds:
            use = min(budget, len(kept))  # refills over-fill by whole groups; trim the tail
            budget -= use
            writes.append(({k: v[:use] for k, v in columns.items()}, kept[:use]))
            dropped.append(np.setdiff1d(idx, kept[:use]))
        if record.gathered:  # shares: the dock holds this process's rows; train takes the whole step's
            self.dock.add(step_rows(record.gathered, writes), key=step, stages=("train",))
            self.dock.discard(np.concatenate([local for local, _ in record.gathered]))
            record.decisions.put(0)
            return
        self.dock.discard(np.concatenate(dropped))
        for columns, kept in writes:
            if len(kept):
                self.dock.put(columns, kept)
        record.decisions.put(0)

    def _timed(self, stage: str, step: int, samples: int, fn):
        timeline = self.p.timeline
        start = timeline.clock()
        with collect_log_values() as logged:
            out = fn()
        end = timeline.clock()
        timeline.record(stage, step, start, end, samples=samples, role=STAGE_ROLES[stage])
        return out, end - start, logged

    # -- the consumer -----------------------------------------------------------------------------
    def _next_step(self, want: int):
        """The next step's samples (a Taken), or None at the end; waits in slices (taking nothing
        until the whole step is ready) so `should_stop` is polled."""
        for wait in _slices(self.timeout_s):
            if self.should_stop():
                return None
            try:
                taken = self.dock.get("train", n=want, one_batch=True, timeout=wait, partial=False)
            except DockClosed:
                self.threads.check()
                raise
            if len(taken.indices):
                return taken
            if not taken.timed_out:
                self.threads.check()
                return None
        self.threads.check()
        raise TimeoutError(f"no step from the producer for {self.timeout_s} s (prefetch_timeout_s)")

    def _consume(self) -> Iterator[ProducedStep]:
        want, p = self.p.plan.global_batch_size, self.p
        while True:
            taken = self._next_step(want)
            if taken is None:
                return  # the feeder finished and every step went through, or should_stop
            batch, idx = taken
            if len(idx) < want:
                raise RuntimeError(f"step {taken.keys[0]}: the dock held {len(idx)} of {want} samples for training")
            step = taken.keys[0]
            record = self.steps.pop(step)
            metrics = {**record.times(), **mean_logs(_merged_logs(record))}
            if p.plan.max_refill_rounds:
                metrics["refill/dropped_samples"] = float(sum(len(i) - len(k) for i, k, _ in record.rounds))
            for stage, s in self.dock.stats().items():
                metrics[f"time/dock_wait/{stage}"] = s.wait_s
                metrics[f"time/dock_waits/{stage}"] = float(s.waits)
                metrics[f"throughput/dock/{stage}/samples_per_s"] = s.samples_per_s
            yield ProducedStep(step, batch, record.position, p.weights.key_for_step(step), record.version, metrics)


def _slices(timeout_s: float | None) -> Iterator[float]:
    """Wait slices of at most _POLL_S that add up to timeout_s (forever when None)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        yield _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))


def _wait_for(decisions: queue.Queue, stop: threading.Event) -> int:
    while True:
        try:
            return decisions.get(timeout=_POLL_S)
        except queue.Empty:
            if stop.is_set():
                raise ProducerStopped() from None


def _merged_logs(record: _Step) -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for stage in _TIMES:
        for name, values in record.logs.get(stage, {}).items():
            merged.setdefault(name, []).extend(values)
    return merged
