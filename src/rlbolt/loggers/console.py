"""``ConsoleWriter``: one compact, human-readable line per step."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from rlbolt.loggers.interface import MetricWriter, scalar_to_float

__all__ = ["ConsoleWriter", "DEFAULT_CONSOLE_KEYS", "format_value"]

# What a person watching a run wants at a glance; the full set goes to jsonl / TB / W&B.
DEFAULT_CONSOLE_KEYS: tuple[str, ...] = (
    "reward/mean",
    "loss",
    "kl",
    "entropy",
    "grad_norm",
    "lr",
    "response_length/mean",
    "time/step",
    "throughput/tokens_per_s",
)


def format_value(value: float) -> str:
    """Formats a float compactly: 4 significant digits, scientific only when very small/large."""
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _tqdm_safe_write(line: str, file: TextIO) -> None:
    # tqdm.write prints above an active progress bar instead of through it.
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        print(line, file=file, flush=True)
        return
    tqdm.write(line, file=file)
    file.flush()


class ConsoleWriter(MetricWriter):
    """Prints ``step 12 | reward/mean 0.5312 | loss -0.01234 | ...`` per ``write_scalars``.

    Args:
        keys: which metrics to show, in this order; missing ones are skipped. ``None`` shows
            ``DEFAULT_CONSOLE_KEYS`` plus every ``val/*`` metric, and falls back to all metrics
            when none of those is present. An empty sequence shows everything.
        file: where to print (default: ``sys.stdout`` at write time).
        printer: ``printer(line)`` replaces printing (for example ``logging.getLogger(...).info``).
    """

    def __init__(self, keys: Sequence[str] | None = None, *, file: TextIO | None = None,
                 printer: Callable[[str], None] | None = None):
        if isinstance(keys, str):
            raise TypeError(f"ConsoleWriter keys must be a sequence of names, got the string {keys!r}; "
                            f"use keys=[{keys!r}]")
        self._keys = None if keys is None else tuple(keys)
        self._file = file
        self._printer = printer

    def _select(self, scalars: Mapping[str, Any]) -> list[str]:
        if self._keys == ():
            return list(scalars)
        if self._keys is not None:
            return [k for k in self._keys if k in scalars]
        chosen = [k for k in DEFAULT_CONSOLE_KEYS if k in scalars]
        chosen += sorted(k for k in scalars if k.startswith("val/"))
        return chosen or list(scalars)

    def _emit(self, line: str) -> None:
        if self._printer is not None:
            self._printer(line)
        else:
            _tqdm_safe_write(line, self._file or sys.stdout)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        parts = [f"step {int(step)}"]
        parts += [f"{k} {format_value(scalar_to_float(k, scalars[k]))}" for k in self._select(scalars)]
        self._emit(" | ".join(parts))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        for name, text in texts.items():
            self._emit(f"step {int(step)} | {name}: {text}")

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._emit("hparams: " + ", ".join(f"{k}={v!r}" for k, v in hparams.items()))
