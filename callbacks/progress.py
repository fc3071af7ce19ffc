"""ProgressBar: a tqdm bar with reward, loss and tokens/s; plain lines when stderr is not a TTY."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from rlbolt.callback import Callback, Periodic
from rlbolt.loggers.console import format_value
from rlbolt.run_info import RunInfo

__all__ = ["ProgressBar"]

# (metric, label) pairs shown after the step counter, in this order, when present.
_SHOWN = (("reward/mean", "reward"), ("loss", "loss"), ("throughput/tokens_per_s", "tok/s"))


def _hms(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _summary(metrics: Mapping[str, float]) -> str:
    return " | ".join(f"{label} {format_value(float(metrics[key]))}" for key, label in _SHOWN if key in metrics)


class ProgressBar(Callback):
    """Shows training progress on process 0.

    On a terminal: a tqdm bar ``train:  12%|##  | 12/100 [00:24<02:56, reward 0.53 | loss
    -0.012 | tok/s 1.2e+04]`` (tqdm estimates the rate and ETA). Otherwise (logs, CI, a pipe):
    plain lines such as ``step 12/100 (12%) | reward 0.5312 | loss -0.01235 | tok/s 1.235e+04 |
    elapsed 0:00:24 | eta 0:02:56``, every ``plain_every_n_steps`` steps or ``plain_every_secs``
    seconds, and always at the last step. The ETA is the mean step time of this run (resumed
    steps excluded) times the steps left.

    Args:
        refresh_every_n_steps: redraw the bar every n steps.
        plain_every_n_steps: plain-line period in steps; ``None``: a twentieth of the run
            (10 when the length is unknown).
        plain_every_secs: plain-line period in seconds (either period triggers a line).
        file: the stream (default ``sys.stderr`` at fit start); its ``isatty()`` picks the mode.
        clock: seconds source for the plain lines' elapsed/ETA (injectable for tests).
        tqdm_kwargs: extra ``tqdm`` arguments (e.g. ``{"mininterval": 1.0, "ncols": 120}``).
    """

    def __init__(self, refresh_every_n_steps: int = 1, *, plain_every_n_steps: int | None = None,
                 plain_every_secs: float | None = 60.0, file: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 tqdm_kwargs: Mapping[str, Any] | None = None):
        if refresh_every_n_steps < 1:
            raise ValueError(f"ProgressBar refresh_every_n_steps={refresh_every_n_steps}; use 1 or more")
        self.refresh_every_n_steps = refresh_every_n_steps
        self.plain_every_n_steps, self.plain_every_secs = plain_every_n_steps, plain_every_secs
        self.file, self.clock = file, clock
        self.tqdm_kwargs = {"desc": "train", "unit": "step", "dynamic_ncols": True, **(tqdm_kwargs or {})}
        self._bar: Any = None
        self._plain: Periodic | None = None

    def on_fit_start(self, run: RunInfo, state) -> None:
        self._bar, self._plain = None, None
        if not run.is_main_process:
            return
        self._out = self.file or sys.stderr
        self._total = run.total_steps
        self._first_step, self._started = state.step, self.clock()
        if _isatty(self._out):
            from tqdm import tqdm

            self._bar = tqdm(total=self._total, initial=state.step, file=self._out, **self.tqdm_kwargs)
        else:
            every = self.plain_every_n_steps or (max(1, self._total // 20) if self._total else 10)
            # agree=False: process 0 alone prints, so its clock decides alone (an agreement would be a collective
            # the other processes never join: a hang, or a mismatch with their next collective)
            self._plain = Periodic(every_n_steps=every, every_secs=self.plain_every_secs, clock=self.clock, agree=False)

    def on_step_end(self, run: RunInfo, info) -> None:
        if self._bar is None and self._plain is None:  # not process 0, or fit not started
            return
        last = info.is_last
        if self._bar is not None:
            if info.step % self.refresh_every_n_steps == 0 or last:
                self._bar.set_postfix_str(_summary(info.metrics), refresh=False)
                self._bar.update(info.step - self._bar.n)
        elif self._plain is not None and (self._plain.should_fire(info.step) or last):
            self._out.write(self._line(info) + "\n")
            self._out.flush()

    def on_fit_end(self, run: RunInfo, state) -> None:
        self._close()

    def on_exception(self, run: RunInfo, exc: BaseException) -> None:
        self._close()

    def _line(self, info) -> str:
        step, total = info.step, self._total
        head = f"step {step}/{total} ({100 * step // total}%)" if total else f"step {step}"
        elapsed = self.clock() - self._started
        parts = [head, _summary(info.metrics), f"elapsed {_hms(elapsed)}"]
        done = step - self._first_step
        if total and done > 0:
            parts.append(f"eta {_hms(elapsed / done * max(0, total - step))}")
        return " | ".join(p for p in parts if p)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._plain = None, None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
