"""Keeps the libraries' own noise off the terminal of the `rlbolt` command.

A failure ends the command with one line that names the problem and the fix. Three kinds of
library output could follow or surround it, and none of it helps the user:

- Orbax logs through absl (warnings and errors of its background save threads): while a run is
  open these records go to train.log (`rundir.attach_log_file`); otherwise they are dropped;
- after a failed asynchronous save, TensorStore callbacks of writes still in flight find their
  asyncio loop closed and print "RuntimeError: Event loop is closed" / "cannot schedule new
  futures after interpreter shutdown" tracebacks through `sys.excepthook`,
  `sys.unraisablehook` or `threading.excepthook`: those (and only those) are diverted to the
  `rlbolt.run` log (so train.log keeps a trace);
- at interpreter shutdown, after the one line, the same threads are torn down: `close_stderr`
  points file descriptor 2 at /dev/null once the command's outcome has been printed.

`RLBOLT_DEBUG=1` turns all of this off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

_NOISE = ("Event loop is closed", "cannot schedule new futures after interpreter shutdown",
          "sys.meta_path is None, Python is likely shutting down")
log = logging.getLogger("rlbolt.run")


def is_shutdown_noise(exc: BaseException | None) -> bool:
    """A library's complaint that its event loop or executor is already gone."""
    return isinstance(exc, (RuntimeError, ImportError)) and any(text in str(exc) for text in _NOISE)


@contextlib.contextmanager
def quiet_libraries(enabled: bool = True) -> Iterator[None]:
    """Drops absl's records (Orbax's logs) and diverts shutdown-noise tracebacks to the log while
    the block runs; restores everything after."""
    if not enabled:
        yield
        return
    absl = logging.getLogger("absl")
    saved = (absl.propagate, list(absl.handlers), sys.excepthook, sys.unraisablehook, threading.excepthook)

    def excepthook(kind, exc, tb):
        if is_shutdown_noise(exc):
            log.info("library noise after a failure (not shown): %s: %s", kind.__name__, exc)
        else:
            saved[2](kind, exc, tb)

    def unraisablehook(unraisable):
        if is_shutdown_noise(unraisable.exc_value):
            log.info("library noise after a failure (not shown): %r", unraisable.exc_value)
        else:
            saved[3](unraisable)

    def thread_excepthook(args):
        if is_shutdown_noise(args.exc_value):
            log.info("library noise in thread %s (not shown): %r", getattr(args.thread, "name", "?"), args.exc_value)
        else:
            saved[4](args)

    absl.propagate, absl.handlers = False, [logging.NullHandler()]
    sys.excepthook, sys.unraisablehook, threading.excepthook = excepthook, unraisablehook, thread_excepthook
    try:
        yield
    finally:
        absl.propagate, absl.handlers = saved[0], saved[1]
        sys.excepthook, sys.unraisablehook, threading.excepthook = saved[2], saved[3], saved[4]


def close_stderr() -> None:
    """Flushes stdout and stderr, then points file descriptor 2 at /dev/null (for the rest of the
    process: what the interpreter's shutdown would print)."""
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
