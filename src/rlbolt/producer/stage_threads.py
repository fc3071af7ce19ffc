"""StageThreads: the producer's stage loops on daemon threads, with their failures handed over.

Failure handling is the point of this file: an exception in any stage stops every stage and is
re-raised in the consumer with that stage's traceback; an exception (or KeyboardInterrupt) in
the consumer stops the stages; every wait wakes periodically or is woken by `on_stop`, so no
failure can hang the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_POLL_S = 0.05


class ProducerStopped(Exception):
    """Raised inside a stage (by `StageThreads.wait` and friends) when the producer is stopping."""


class StageThreads:
    """Runs named loops on daemon threads named `<prefix>-<name>`.

    Args:
      on_stop: called once when the stages must stop (a failure or `stop()`); it should wake
        every stage that is blocked (e.g. close the dock they wait on).
      prefix: the threads' name prefix.
      quiet: exception types that mean "stopped" once stopping began (not failures).
    """

    def __init__(self, on_stop: Callable[[], None] = lambda: None, *, prefix: str = "rlbolt-producer",
                 quiet: tuple[type[BaseException], ...] = ()):
        self.stop_event = threading.Event()
        self._on_stop, self._prefix, self._quiet = on_stop, prefix, (ProducerStopped, *quiet)
        self._threads: list[threading.Thread] = []
        self._failure: tuple[str, BaseException] | None = None
        self._lock = threading.Lock()
        self.stopped = False  # stop() was called (a second call from a context exit is not needed)

    def start(self, name: str, loop: Callable[[threading.Event], None]) -> None:
        """Starts `loop(stop_event)` on a new thread; the loop returns when its work is done."""
        thread = threading.Thread(target=self._run, args=(name, loop), name=f"{self._prefix}-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self, name: str, loop: Callable[[threading.Event], None]) -> None:
        try:
            loop(self.stop_event)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, never swallowed
            if isinstance(exc, self._quiet) and self.stop_event.is_set():
                return  # a consequence of stopping, not a cause
            with self._lock:
                if self._failure is None:
                    self._failure = (name, exc)
            self._signal_stop()

    def _signal_stop(self) -> None:
        with self._lock:
            first = not self.stop_event.is_set()
            self.stop_event.set()
        if first:
            self._on_stop()

    def check(self) -> None:
        """Re-raises the first stage failure in the caller, noting which thread raised it."""
        if self._failure is not None:
            name, exc = self._failure
            note = f"(raised in the producer thread {self._prefix}-{name}; its frames are above)"
            if note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise exc

    def request_stop(self) -> None:
        """Asks every stage to stop and wakes them, without waiting (a stage inside a hook, e.g.
        a rollout, stops at its next wait)."""
        self._signal_stop()

    def stop(self, join_timeout_s: float = 10.0, *, strict: bool = True) -> bool:
        """Asks every stage to stop, wakes them, and joins the threads.

        Args:
          join_timeout_s: how long to wait for the threads (a stage stops at its next wait,
            after the hook call it is in).
          strict: raise RuntimeError when a thread is still alive after the wait; with False,
            return False instead (the daemon threads end with the process or at their next wait).

        Returns:
          True when every thread has ended.
        """
        self.stopped = True
        self._signal_stop()
        deadline = time.monotonic() + join_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive and strict:
            raise RuntimeError(f"producer thread(s) {alive} did not stop within {join_timeout_s} s")
        return not alive

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @staticmethod
    def wait(condition: Callable[[], bool], stop_event: threading.Event, cond: threading.Condition) -> None:
        """Blocks until `condition()` holds (checked under `cond`), polling `stop_event`."""
        with cond:
            while not condition():
                if stop_event.is_set():
                    raise ProducerStopped()
                cond.wait(_POLL_S)
