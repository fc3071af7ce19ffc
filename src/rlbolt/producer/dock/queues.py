"""StageQueue: one stage's view of the dock: the samples it has not taken, by batch, its lock,
and its counters. The choice of what a `get` takes is made here, under the stage's own lock,
from the samples' column sets (written by `put`) and their groups; the rules are
`selection.choose`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping

from rlbolt.producer.dock.selection import Choice, DockError, choose


@dataclasses.dataclass
class StageStats:
    """Per-stage counters since the last `ExperienceDock.stats(reset=True)`.

    Attributes:
      gets: `get` calls served.
      waits: calls that had to block for samples.
      wait_s: seconds spent blocked.
      timeouts: calls that returned because their time-out passed.
      samples: samples taken.
      window_s: seconds the counters cover.
    """

    gets: int = 0
    waits: int = 0
    wait_s: float = 0.0
    timeouts: int = 0
    samples: int = 0
    window_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.window_s if self.window_s > 0 else 0.0


class StageQueue:
    """The untaken samples of one stage (batch seq -> samples in index order), under `cond`."""

    __slots__ = ("name", "inputs", "cond", "pending", "stats", "window_start")

    def __init__(self, name: str, inputs: tuple[str, ...], now: float):
        self.name, self.inputs = name, inputs
        self.cond = threading.Condition(threading.Lock())
        self.pending: dict[int, dict[int, None]] = {}
        self.stats, self.window_start = StageStats(), now

    def choose(self, samples: Mapping, need: frozenset, n: int | None, whole_groups: bool, one_batch: bool) -> Choice:
        """What a get would take now (caller holds `cond`): oldest batch first, index order."""
        seqs = sorted(self.pending)
        if one_batch:
            seqs = seqs[:1]
        ready = lambda i: need <= samples[i].columns
        return choose(self._units(samples, seqs, n, whole_groups), ready, n)

    def _units(self, samples: Mapping, seqs: list[int], n: int | None, whole_groups: bool) -> Iterator[list[int]]:
        for seq in seqs:
            pending = self.pending[seq]
            if not whole_groups:
                yield from ([i] for i in pending)
                continue
            seen = set()
            for i in pending:
                sample = samples[i]
                if sample.group in seen:
                    continue
                seen.add(sample.group)
                # tuple(): one atomic copy; the list may lose forgotten members meanwhile
                members = [j for j in tuple(sample.batch.groups[sample.group]) if j in pending]
                if n is not None and len(members) > n:
                    raise DockError(f"get({self.name!r}): a group of {len(members)} samples does not fit n={n} "
                                    "with whole_groups=True; ask for n >= the group size")
                yield members

    def take(self, samples: Mapping, chosen: list[int]) -> None:
        """Marks `chosen` taken (caller holds `cond`)."""
        for i in chosen:
            self.pending[samples[i].batch.seq].pop(i)
        self.drop_empty()

    def drop_empty(self) -> None:
        for seq in [s for s, pending in self.pending.items() if not pending]:
            del self.pending[seq]
