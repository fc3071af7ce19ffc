"""TimelineLogger: appends the Trainer's stage events to `<run_dir>/timeline.jsonl` (process 0).

Each flush is one `write` on a file opened with O_APPEND, so lines of a run and of its resume
(or of another writer) never interleave mid-line; a process killed mid-write leaves at most a
torn last line, which `rlbolt.timeline.read_timeline` skips. `rlbolt plot` draws the file as a Gantt chart.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlbolt.callback import Callback
from rlbolt.run_info import RunInfo
from rlbolt.timeline import append_events

__all__ = ["TimelineLogger"]


class TimelineLogger(Callback):
    """Writes `run.timeline` events after every step, at the end and on an exception.

    Args:
      filename: the file under `run.run_dir`.
    """

    order = 0

    def __init__(self, filename: str = "timeline.jsonl"):
        self.filename = filename
        self.path: Path | None = None
        self.run = 0.0

    def on_fit_start(self, run: RunInfo, state) -> None:
        self.run = time.time()  # stamps this fit's events: a resumed run appends its own
        if run.is_main_process:
            self.path = Path(run.run_dir) / self.filename
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, run: RunInfo, info) -> None:
        self._flush(run)

    def on_validation_end(self, run: RunInfo, step, metrics) -> None:
        self._flush(run)

    def on_fit_end(self, run: RunInfo, state) -> None:
        self._flush(run)

    def on_exception(self, run: RunInfo, exc) -> None:
        self._flush(run)

    def _flush(self, run: RunInfo) -> None:
        events = run.timeline.drain()
        if self.path is not None and events:
            append_events(self.path, [{**e, "run": self.run} for e in events])
