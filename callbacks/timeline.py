"""TimelineLogger: appends the Trainer's stage events to `<run_dir>/timeline.jsonl` (process 0).

Each flush is one `write` on a file opened with O_APPEND, so lines of a run and of its resume
(or of another writer) never interleave mid-line; a process killed mid-write leaves at most a
torn last line, which `rlbolt.timeline.read_timeline` skips. `rlbolt plot` draws the file as a Gantt chart.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlbolt.callback import Callback
from rlbolt.timeline import append_events

__all__ = ["TimelineLogger"]


class TimelineLogger(Callback):
    """Writes `trainer.timeline` events after every step, at the end and on an exception.

    Args:
      filename: the file under `trainer.run_dir`.
    """

    order = 0

    def __init__(self, filename: str = "timeline.jsonl"):
        self.filename = filename
        self.path: Path | None = None
        self.run = 0.0

    def on_fit_start(self, trainer, state) -> None:
        self.run = time.time()  # stamps this fit's events: a resumed run appends its own
        if trainer.is_main_process:
            self.path = Path(trainer.run_dir) / self.filename
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, trainer, info) -> None:
        self._flush(trainer)

    def on_validation_end(self, trainer, step, metrics) -> None:
        self._flush(trainer)

    def on_fit_end(self, trainer, state) -> None:
        self._flush(trainer)

    def on_exception(self, trainer, exc) -> None:
        self._flush(trainer)

    def _flush(self, trainer) -> None:
        events = trainer.timeline.drain()
        if self.path is not None and events:
            append_events(self.path, [{**e, "run": self.run} for e in events])
