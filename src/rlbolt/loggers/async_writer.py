"""``AsyncWriter``: runs a writer's calls on a background thread, in order.

Slow backends (a network filesystem, W&B on a bad link) then cost the training loop one queue
put per call. A failure inside the background thread is not lost: it is re-raised, with its
original traceback, by the next call on the writer (``write_*``, ``flush`` or ``close``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from rlbolt.loggers.interface import MetricWriter

__all__ = ["AsyncWriter"]

_log = logging.getLogger(__name__)
_STOP = object()


class AsyncWriter(MetricWriter):
    """Wraps a writer so its calls run on one daemon thread, in submission order.

    Args:
        writer: the wrapped writer (rlbolt's or CLU's).
        max_pending: calls that may wait in the queue; when full, callers block, which bounds
            memory if the backend falls behind.
    """

    def __init__(self, writer: Any, *, max_pending: int = 1024):
        if max_pending < 1:
            raise ValueError(f"AsyncWriter max_pending={max_pending}; use a positive number such as 1024")
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="rlbolt-async-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                fn, args = item
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                with self._error_lock:
                    if self._error is None:
                        self._error = exc
                    else:
                        _log.error("AsyncWriter: another writer failure while one is pending: %r", exc)
            finally:
                self._queue.task_done()

    def _raise_pending(self) -> None:
        with self._error_lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._raise_pending()
        if self._closed:
            raise RuntimeError("AsyncWriter is closed; create a new writer")
        self._queue.put((fn, args))

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        # Copied so the caller may reuse or mutate its dict right away.
        self._submit(self.writer.write_scalars, step, dict(scalars))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._submit(self.writer.write_texts, step, dict(texts))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._submit(self.writer.write_hparams, dict(hparams))

    def flush(self) -> None:
        """Waits until every queued call ran and the wrapped writer flushed; re-raises failures."""
        self._submit(self.writer.flush)
        self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Drains the queue, closes the wrapped writer, stops the thread; re-raises failures."""
        # Closes the wrapped writer even when an earlier failure is pending, then reports it.
        if not self._closed:
            self._closed = True
            self._queue.put((self.writer.close, ()))
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_pending()
