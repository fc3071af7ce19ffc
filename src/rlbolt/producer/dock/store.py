"""ExperienceDock: a column store over the samples in flight, between pipeline stages.

Producers write columns for samples; each stage takes the samples whose input columns are all
written and which it has not taken yet, at its own dispatch size. Samples enter with `add`
(their first columns, e.g. the prompts), gain columns with `put`, leave a stage's queue with
`get` (taken) or `discard` (dropped), and are forgotten once every stage took or skipped them.

Locking (the contract the multi-host backends in docs/architecture.md keep):
  - `add` takes the registry lock (sample indices and batches are handed out in order);
  - `put` takes only the locks of the columns it writes (columns.py), for dictionary updates
    (arrays are converted before); writers of different columns never wait for each other;
  - `get` takes its stage's lock to choose indices and mark them taken (queues.py), then copies
    the data with no lock held; a writer rings each stage's doorbell (a notify) after it wrote;
  - no call holds two kinds of lock at once, so no lock order can deadlock.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from rlbolt.batch import Batch
from rlbolt.producer.dock.columns import ColumnStore, as_arrays, common_size, few
from rlbolt.producer.dock.queues import StageQueue, StageStats
from rlbolt.producer.dock.selection import DockError


class DockClosed(RuntimeError):
    """The dock was closed (the pipeline is stopping or failed): no call can be served."""


class Taken(tuple):
    """What `get` returns: the pair (batch, indices), which unpacks as such, plus `keys`.

    Attributes:
      batch: the taken samples' columns.
      indices: [K] int64 sample indices.
      keys: the batch key of each taken sample (the samples may be forgotten by the time the
        caller asks, once every stage is done with them).
      timed_out: the call returned because its time-out passed.
    """

    def __new__(cls, batch: Batch, indices: np.ndarray, keys: list, timed_out: bool = False):
        taken = super().__new__(cls, (batch, indices))
        taken.keys, taken.timed_out = keys, timed_out
        return taken

    @property
    def batch(self) -> Batch:
        return self[0]

    @property
    def indices(self) -> np.ndarray:
        return self[1]


class _Sample:
    __slots__ = ("batch", "group", "columns", "owed")

    def __init__(self, batch: "_Batch", group: Hashable, stages: Sequence[str]):
        self.batch, self.group = batch, group
        self.columns: set[str] = set()  # grows by whole puts (set.update is one atomic call)
        self.owed = set(stages)  # stages that have not finished with this sample


class _Batch:
    __slots__ = ("key", "seq", "groups")

    def __init__(self, key: Hashable, seq: int):
        self.key, self.seq = key, seq
        self.groups: dict[Hashable, list[int]] = {}  # group id -> members, in index order


class ExperienceDock:
    """Named columns over the samples of the global batches in flight.

    Args:
      stages: stage name -> its input columns: a sample is ready for a stage once all of them
        (and any extra column a `get` asks for) are written.
      columns: every column name the dock may hold; None: any column a `put`/`add` writes
        (a `get` still refuses a name that no stage declares and nobody wrote).
      clock: seconds, for the wait and rate counters (injectable in tests).

    Example:
      dock = ExperienceDock({"score": ("text",), "train": ("text", "score")})
      idx = dock.add({"text": texts, "group_ids": groups}, key=step)
      batch, idx = dock.get("score", n=8)
      dock.put({"score": scores(batch)}, idx)
    """

    def __init__(self, stages: Mapping[str, Sequence[str]], *, columns: Sequence[str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not stages:
            raise DockError("stages is empty; name at least one stage and its input columns")
        self._clock = clock
        self._allowed = None if columns is None else frozenset(columns)
        self._stages = {name: StageQueue(name, tuple(inputs), clock()) for name, inputs in stages.items()}
        if self._allowed is not None:
            for stage in self._stages.values():
                self._check_known(stage.inputs, f"stage {stage.name!r}'s inputs")
        self._declared = frozenset(c for s in self._stages.values() for c in s.inputs) | (self._allowed or frozenset())
        self._rows = ColumnStore()
        self._samples: dict[int, _Sample] = {}
        self._batches: dict[Hashable, _Batch] = {}
        self._registry = threading.Lock()
        self._next_index, self._batch_seq = 0, itertools.count()
        self._finished = self._closed = False
        self._close_reason: str | None = None

    # -- writing ------------------------------------------------------------------------------
    def add(self, columns: Mapping[str, Any], *, key: Hashable = None, group_ids: Any = None,
            stages: Sequence[str] | None = None) -> np.ndarray:
        """New samples, one per row of `columns`, with those columns written.

        Args:
          columns: the samples' first columns (e.g. prompts), all with the same leading size.
          key: the batch the samples join (a global step); adds with the same key extend it,
            so a refill round joins its step. None: a new batch of their own.
          group_ids: [N] ids; samples of one batch with the same id form a group (default: the
            `group_ids` column if written, else every sample is its own group).
          stages: the stages that will take these samples (default: every stage); e.g. rows
            that enter mid-pipeline with the earlier stages' columns already written.

        Returns:
          [N] int64 indices of the new samples.
        """
        arrays = as_arrays(columns, "add")
        n = common_size(arrays, "add")
        if self._allowed is not None:
            self._check_known(list(arrays), "add")
        if group_ids is None:
            group_ids = arrays.get("group_ids", np.arange(n))
        groups = np.asarray(group_ids)
        if groups.shape != (n,):
            raise DockError(f"add: group_ids has shape {list(groups.shape)}, expected [{n}]")
        owed = list(dict.fromkeys(self._stage(name).name for name in stages)) if stages is not None else list(self._stages)
        if not owed:
            raise DockError("add: stages is empty; name the stages that will take the samples (None: every stage)")
        with self._registry:
            self._check_open("add")
            if self._finished:
                raise DockError("add after finish(): the dock was told no more samples would come")
            batch = self._batches.get(key) if key is not None else None
            if batch is None:
                batch = _Batch(key, next(self._batch_seq))
                self._batches[key if key is not None else ("_anon", batch.seq)] = batch
            indices = np.arange(self._next_index, self._next_index + n, dtype=np.int64)
            self._next_index += n
            for i, g in zip(indices.tolist(), groups.tolist()):
                self._samples[i] = _Sample(batch, g, owed)
                batch.groups.setdefault(g, []).append(i)
        for name in owed:
            stage = self._stages[name]
            with stage.cond:
                stage.pending.setdefault(batch.seq, {}).update(dict.fromkeys(indices.tolist()))
        if arrays:
            self._write(arrays, indices, "add")
        else:
            self._ring()
        return indices

    def put(self, columns: Mapping[str, Any], indices: Any) -> None:
        """Writes columns for existing samples.

        Args:
          columns: name -> array with one row per index.
          indices: [N] sample indices (from `add` or `get`), no repeats.

        Raises:
          DockError: a sample that does not exist (never added, or already forgotten), a column
            already written for one of the samples (a double write), or a shape mismatch.
        """
        idx = as_indices(indices, "put")
        self._check_open("put")
        missing = [i for i in idx.tolist() if i not in self._samples]
        if missing:
            raise DockError(f"put: sample(s) {few(missing)} do not exist (never added, or every stage is done with "
                            f"them); write only indices that add() or get() returned")
        arrays = as_arrays(columns, "put")
        n = common_size(arrays, "put")
        if n != len(idx):
            raise DockError(f"put: the columns have {n} rows for {len(idx)} indices")
        self._write(arrays, idx, "put")

    def discard(self, indices: Any) -> None:
        """Drops samples from every stage that has not taken them (e.g. groups a filter removed)."""
        idx = as_indices(indices, "discard").tolist()
        never = [i for i in idx if not 0 <= i < self._next_index]
        if never:
            raise DockError(f"discard: sample(s) {few(never)} were never added")
        for stage in self._stages.values():
            with stage.cond:
                for i in idx:
                    sample = self._samples.get(i)
                    if sample is not None and stage.pending.get(sample.batch.seq, {}).pop(i, "taken") is None:
                        sample.owed.discard(stage.name)
                stage.drop_empty()
                stage.cond.notify_all()
        self._forget_done(idx)

    def finish(self) -> None:
        """No more samples will be added: a blocked `get` returns what remains instead of waiting."""
        with self._registry:
            self._finished = True
        self._ring()

    def close(self, reason: str | None = None) -> None:
        """Stops the dock: every blocked and later call raises DockClosed.

        Args:
          reason: one line saying why, which every DockClosed then carries (e.g. the process that
            stopped answering); None: the pipeline stopped. A second close keeps the first reason.
        """
        with self._registry:
            if not self._closed:
                self._closed, self._close_reason = True, reason
        self._ring()

    # -- reading ------------------------------------------------------------------------------
    def get(self, stage: str, n: int | None = None, *, whole_groups: bool = False, one_batch: bool = False,
            timeout: float | None = None, partial: bool = True, _stop: threading.Event | None = None) -> Taken:
        """Takes up to `n` samples that are ready for `stage`, marking them taken by it.

        Ready means every input column of the stage is written.
        Samples are taken in dock order (batches in the order they were added, then index
        order), skipping those not ready yet.

        A consumer that wants micro batches of equal work reorders what it took:
        `rlbolt.producer.dock.selection.balanced(taken, micro)`.

        Args:
          stage: a stage named at construction.
          n: the most samples to take; None: no limit.
          whole_groups: take only whole groups (a group is taken when all its pending samples
            are ready, and never split); a group larger than `n` is an error.
          one_batch: take from one batch only: the oldest with samples this stage has not
            taken. A blocking call then also returns when that batch has nothing left to wait
            for, with fewer than `n` samples (the end of a round).
          timeout: the most seconds to wait until `n` samples are taken (or, with one_batch, the
            batch is done; or `finish()` left nothing to wait for); then what is ready is returned
            (maybe nothing). None: wait as long as it takes; 0: take what is ready now.
          partial: False: a time-out (or timeout=0) takes nothing unless `n` samples (or,
            with one_batch, the rest of the batch) are ready, so a consumer can wait in slices
            without splitting what it waits for.
          _stop: (for a server that serves this dock) once set and the dock rung, a waiting
            call raises DockClosed instead of waiting on.

        Returns:
          (batch, indices) as a `Taken` (also holding each sample's batch key): the taken
          samples' columns (every column written for all of them) and their [K] int64 indices, K <= n. K == 0 after a time-out, a
          non-blocking call with nothing ready, or `finish()`.

        Raises:
          DockError: an unknown stage, n < 1, or a group larger than n.
          DockClosed: the dock was closed before or while waiting.
        """
        st = self._stage(stage)
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise DockError(f"get: n={n!r} must be a positive integer or None")
        need = frozenset(st.inputs)
        start = self._clock()
        deadline = None if timeout is None else start + max(0.0, timeout)
        block = timeout is None or timeout > 0
        waited = timed_out = False
        with st.cond:
            while True:
                self._check_open("get")
                if _stop is not None and _stop.is_set():
                    raise DockClosed("get: the dock server is shutting down")
                choice = st.choose(self._samples, need, n, whole_groups, one_batch)
                if choice.full or not block:
                    break
                if choice.unready == 0 and ((one_batch and choice.indices) or self._finished):
                    break
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    timed_out = True
                    break
                waited = True
                st.cond.wait(remaining)
            complete = choice.full or (choice.unready == 0 and ((one_batch and choice.indices) or self._finished))
            chosen = choice.indices if partial or complete else []
            st.take(self._samples, chosen)
            names = _common_columns(self._samples[i] for i in chosen)
            keys = [self._samples[i].batch.key for i in chosen]
            stats = st.stats
            stats.gets += 1
            stats.samples += len(chosen)
            stats.waits += waited
            stats.timeouts += timed_out
            stats.wait_s += (self._clock() - start) if waited else 0.0
        try:
            batch = self._rows.gather(chosen, names)
        finally:
            for i in chosen:
                self._samples[i].owed.discard(stage)
            self._forget_done(chosen)
        return Taken(batch, np.asarray(chosen, np.int64), keys, timed_out)

    def stats(self, reset: bool = True) -> dict[str, StageStats]:
        """Per-stage counters since the last reset (then start a new window when reset)."""
        out = {}
        now = self._clock()
        for stage in self._stages.values():
            with stage.cond:
                s = dataclasses.replace(stage.stats, window_s=now - stage.window_start)
                if reset:
                    stage.stats, stage.window_start = StageStats(), now
            out[stage.name] = s
        return out

    def batch_key(self, index: int) -> Hashable:
        """The batch key of a sample the dock holds (None once every stage is done with it)."""
        sample = self._samples.get(int(index))
        return None if sample is None else sample.batch.key

    def __len__(self) -> int:
        """Samples the dock holds (added and not yet finished with by every stage)."""
        return len(self._samples)

    # -- internals ------------------------------------------------------------------------------
    def _stage(self, name: str) -> StageQueue:
        try:
            return self._stages[name]
        except (KeyError, TypeError):
            raise DockError(f"unknown stage {name!r}; stages: {list(self._stages)}") from None

    def _check_known(self, names: Sequence[str], where: str) -> None:
        known = self._allowed if self._allowed is not None else self._declared | self._rows.names()
        unknown = [c for c in names if c not in known]
        if unknown:
            raise DockError(f"{where}: unknown column(s) {unknown}; columns: {sorted(known)}")

    def _check_open(self, what: str) -> None:
        if self._closed:
            reason = self._close_reason
            raise DockClosed(f"{what}: the dock is closed" + (f": {reason}" if reason else " (the pipeline stopped)"))

    def _write(self, arrays: dict[str, np.ndarray], idx: np.ndarray, what: str) -> None:
        if self._allowed is not None:
            self._check_known(list(arrays), what)
        self._rows.write(arrays, idx, what)
        names = list(arrays)
        for i in idx.tolist():
            sample = self._samples.get(i)
            if sample is not None:
                sample.columns.update(names)  # one call: readers see all of this put or none of it
        self._ring()

    def _ring(self) -> None:
        for stage in self._stages.values():
            with stage.cond:
                stage.cond.notify_all()

    def _forget_done(self, indices: Sequence[int]) -> None:
        """Forgets samples every stage is done with (taken and copied, or discarded)."""
        gone = []
        for i in indices:
            sample = self._samples.get(i)
            if sample is not None and not sample.owed and self._samples.pop(i, None) is not None:
                gone.append((i, sample))
        if not gone:
            return
        self._rows.forget([i for i, _ in gone])
        with self._registry:
            for i, sample in gone:
                members = sample.batch.groups.get(sample.group)
                if members is not None:
                    members.remove(i)
                    if not members:
                        del sample.batch.groups[sample.group]
                if not sample.batch.groups:
                    self._batches = {k: b for k, b in self._batches.items() if b is not sample.batch}


def as_indices(indices: Any, what: str) -> np.ndarray:
    """[N] int64 sample indices, no repeats (one clear line otherwise)."""
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise DockError(f"{what}: indices must be a 1-D integer array, got dtype {idx.dtype} shape {list(idx.shape)}")
    idx = idx.astype(np.int64)
    if len(np.unique(idx)) != len(idx):
        raise DockError(f"{what}: indices repeat a sample; each sample may appear once")
    return idx


def _common_columns(samples) -> list[str]:
    sets = [s.columns for s in samples]
    return sorted(sets[0].intersection(*sets[1:])) if sets else []
