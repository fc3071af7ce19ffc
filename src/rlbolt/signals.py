"""SIGINT / SIGTERM during `Trainer.fit`: stop at the next safe point, save, exit cleanly.

`Trainer.fit` wraps itself in `StopOnSignal(trainer)`. While fit sets up (module, parameters,
restore), no step has run in this fit, so a signal raises `Interrupted` at once: there is
nothing new to save. Once the loop runs (`defer()`), the first signal only records itself:

    trainer.stop_signal = signum     which signal (signal.SIGINT or signal.SIGTERM)
    trainer.should_stop = True       THE stop flag: fit reads it after every step and while it
                                     waits for the producer, and ends the loop there

so the step in progress completes (its callbacks too). Fit then sets `trainer.interrupted`
and ends through `on_fit_end` (ModelCheckpoint saves the last completed step, the loggers
flush; callbacks that do long end-of-run work skip it when `trainer.interrupted`), and joins
the producer thread. The first signal
also prints one line on stderr, and a second signal ends the process at once, quietly: the
first one restores the signals' default action, so the kernel ends the process the moment the
second arrives (the shell's status 128 + signum: 130 for SIGINT, 143 for SIGTERM; a parent's
`Popen.returncode` -signum). A Python handler could not promise that: the kernel hands a
process's signal to any of its threads, and when another thread takes it the handler runs only
once the main thread is back in Python, after the sleep or blocking call it is in (seen: a
second SIGTERM during a callback's 5 s sleep ended the process 5 s late). The checkpoints on
disk stay valid because every save is atomic.

Handlers are installed only from the main thread (Python delivers signals there) and the
previous handlers are restored when fit ends. A multi-process run must agree on the step at
which to stop; that decision is made where `should_stop` is read.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived before the first step of a fit (while it set up or restored),
    or outside a fit in the `rlbolt` command: raised at once, there is nothing new to save.

    Attributes:
      signum: the signal number.
      step: the last completed step (None when raised before the loop started).
    """

    def __init__(self, signum: int, step: int | None = None):
        super().__init__(signum, step)
        self.signum, self.step = signum, step

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell convention for a process ended by this signal: 128 + signum."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}" + ("" if self.step is None else f" after step {self.step}")


class StopOnSignal:
    """Installs the SIGINT/SIGTERM handlers of a fit (a context manager; see the module doc).

    Args:
      on_stop: called with the signal's number at the first signal once `defer` was called (the fit
        then stops at its next safe point).
      announce: print one line on stderr at the first signal.
    """

    def __init__(self, on_stop: Callable[[int], None], *, announce: bool = True):
        self.on_stop, self.announce = on_stop, announce
        self.deferring = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._first)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def defer(self) -> None:
        """From now on a signal stops the run at the next safe point instead of at once."""
        self.deferring = True

    def _first(self, signum: int, frame) -> None:
        del frame
        if not self.deferring:
            raise Interrupted(signum)
        self.on_stop(signum)
        for other in self._previous:  # the kernel acts on the next one, whichever thread it reaches
            signal.signal(other, signal.SIG_DFL)
        if self.announce:
            name = signal.Signals(signum).name
            # os.write, not print: a handler may run in the middle of another write to stderr.
            _write_stderr(f"\nrlbolt: {name} received: stopping after the current step and saving a checkpoint "
                          f"(send it again to exit at once without saving)\n")


def _write_stderr(text: str) -> None:
    try:
        os.write(2, text.encode())
    except OSError:
        pass


class RaiseOnSignal:
    """Outside a fit (the `rlbolt` command's set-up, plots, export): SIGINT and SIGTERM raise
    `Interrupted` at once in the main thread, so the command can end with one line and the
    conventional exit status. A context manager that restores the previous handlers."""

    def __enter__(self) -> RaiseOnSignal:
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, _raise_interrupted)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _raise_interrupted(signum: int, frame) -> None:
    del frame
    raise Interrupted(signum)
