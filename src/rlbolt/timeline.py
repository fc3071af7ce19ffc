"""Timeline: when every stage ran, per step and per dispatch, for a Gantt chart of the pipeline.

Each event is a plain dict:

    {"stage": "rollout", "step": 3, "start": 1717000000.12, "end": 1717000000.48,
     "samples": 8, "role": "rollout", "thread": "rlbolt-producer-rollout"}

`start`/`end` are wall-clock seconds (time.time), so events of several processes, or of a run
and its resume, share one axis. `role` names what a placement puts on devices (rollout, train,
reference, host); a placement may add fields such as the devices that ran the stage. The
Trainer owns one Timeline; the producer's stage threads and the update record into it, and
`rlbolt.callbacks.TimelineLogger` appends the events to `<run_dir>/timeline.jsonl`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


class Timeline:
    """A thread-safe, bounded buffer of stage events.

    Args:
      max_events: events kept until drained (the oldest go first when nobody drains).
      clock: wall-clock seconds (injectable in tests).
    """

    def __init__(self, max_events: int = 100_000, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()

    def record(self, stage: str, step: int, start: float, end: float, **fields: Any) -> None:
        """Adds one event (fields: samples, role, devices, ...); the thread's name is added."""
        event = {"stage": stage, "step": int(step), "start": float(start), "end": float(end),
                 "thread": threading.current_thread().name, **fields}
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, stage: str, step: int, **fields: Any) -> Iterator[None]:
        """Records the time the body takes as one event (also when it raises)."""
        start = self.clock()
        try:
            yield
        finally:
            self.record(stage, step, start, self.clock(), **fields)

    def drain(self) -> list[dict[str, Any]]:
        """The events recorded since the last drain, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events


def append_events(path: str | Path, events: Sequence[dict[str, Any]]) -> None:
    """Appends events as JSON lines with O_APPEND writes (one call unless the kernel writes less),
    so concurrent or successive writers never interleave inside a line."""
    data = "".join(json.dumps(e, sort_keys=True) + "\n" for e in events).encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn line from a killed writer stays alone
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_timeline(path: str | Path) -> list[dict[str, Any]]:
    """The events of a timeline.jsonl, skipping a torn last line (a kill mid-write).

    Raises:
      FileNotFoundError: naming the file when it does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a run writes it when TimelineLogger is among its callbacks")
    events = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and {"stage", "step", "start", "end"} <= event.keys():
            events.append(event)
    return events
