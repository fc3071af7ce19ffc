"""DataPrefetcher: runs a producer generator on a thread, handing items over a bounded queue.

Failure handling is the point of this file: an exception in the producer is re-raised in the
consumer with the producer's traceback; an exception (or KeyboardInterrupt) in the consumer stops
the producer; every blocking put/get wakes up periodically so no failure can hang the process.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_POLL_S = 0.05


class _End:
    """End-of-data sentinel."""


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class ProducerStopped(Exception):
    """Raised inside the producer (by `wait`/`put`) when the consumer asked it to stop."""


class DataPrefetcher:
    """Iterates the items of `produce(stop_event)` produced ahead on a daemon thread.

    Args:
      produce: a function taking the stop event and returning an iterator of items. Long waits
        inside it should poll the event (or call `DataPrefetcher.wait`).
      depth: queue capacity: how many items may wait for the consumer (bounds memory).
      timeout_s: the consumer raises TimeoutError if no item arrives for this long (None: wait
        forever, still waking to notice a dead producer).
      name: the thread's name.
      should_stop: polled while the consumer waits; when it returns True, iteration ends as if
        the data had run out (a stop request while no step is running takes effect at once).

    Use as a context manager: `with DataPrefetcher(fn) as items: for item in items: ...`.
    """

    def __init__(self, produce: Callable[[threading.Event], Iterator[Any]], *, depth: int = 1,
                 timeout_s: float | None = None, name: str = "rlbolt-producer",
                 should_stop: Callable[[], bool] | None = None):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        self._produce, self._timeout_s, self._name = produce, timeout_s, name
        self._should_stop = should_stop or (lambda: False)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop_event = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.produced = 0
        self.consumed = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> DataPrefetcher:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> DataPrefetcher:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        if not self._stopped:
            self.stop()

    def stop(self, join_timeout_s: float = 10.0, *, strict: bool = True) -> bool:
        """Asks the producer to stop, unblocks it, and joins the thread.

        Args:
          join_timeout_s: how long to wait for the thread (it stops at its next poll, after the
            hook call it is in, e.g. a rollout).
          strict: raise RuntimeError when the thread is still alive after the wait; with False,
            return False instead (the daemon thread ends with the process or at its next poll).

        Returns:
          True when the thread has ended.
        """
        self._stopped = True
        self.stop_event.set()
        deadline = time.monotonic() + join_timeout_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            self._drain()
            self._thread.join(_POLL_S)
        self._drain()
        if self._thread is not None and self._thread.is_alive():
            if strict:
                raise RuntimeError(f"producer thread {self._name!r} did not stop within {join_timeout_s} s")
            return False
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def state_dict(self) -> dict:
        """Counters only: a resumed run restarts production from the consumed position."""
        return {"produced": self.produced, "consumed": self.consumed}

    # -- consumer side -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self._thread is None:
            self.start()
        while True:
            item = self._get()
            if isinstance(item, _End):
                return
            if isinstance(item, _Failure):
                item.exc.add_note(f"(raised in the producer thread {self._name!r}; its frames are above)")
                raise item.exc
            self.consumed += 1
            yield item

    def _get(self) -> Any:
        waited = 0.0
        while not self._should_stop():
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                waited += _POLL_S
                if not self.alive and self._queue.empty():
                    raise RuntimeError(f"producer thread {self._name!r} died without reporting")
                if self._timeout_s is not None and waited >= self._timeout_s:
                    raise TimeoutError(f"no item from the producer for {self._timeout_s} s (timeout_s)")
        return _End()

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    # -- producer side -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for item in self._produce(self.stop_event):
                if not self._put(item):
                    return
                self.produced += 1
            self._put(_End())
        except ProducerStopped:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, never swallowed
            self._put(_Failure(exc))

    def _put(self, item: Any) -> bool:
        while not self.stop_event.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    @staticmethod
    def wait(condition: Callable[[], bool], stop_event: threading.Event, cond: threading.Condition) -> None:
        """Blocks until `condition()` holds (checked under `cond`), polling `stop_event`."""
        with cond:
            while not condition():
                if stop_event.is_set():
                    raise ProducerStopped()
                cond.wait(_POLL_S)
