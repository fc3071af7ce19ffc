"""``JsonlWriter``: metrics as JSON lines, the format scripts and plots read back.

Each ``write_scalars`` call appends one line to ``metrics.jsonl``::

    {"step": 12, "loss": 0.031, "reward/mean": 0.5, "kl": "nan"}

- ``step`` is an integer; every other value is a JSON number (a float).
- JSON has no nan or infinity, so non-finite values are written as the strings ``"nan"``,
  ``"inf"`` and ``"-inf"``; ``read_jsonl`` turns them back into floats. (Python's default of
  bare ``NaN`` tokens would make the file unreadable by strict parsers such as ``jq``.)
- Every line is flushed to the operating system as it is written, so killing the process (even
  with SIGKILL) loses at most the line being written. A torn last line left by such a kill is
  cut off when the file is next opened, so a resumed run appends clean lines.
- Opening an existing file appends (resume). A resumed run may repeat steps the killed run had
  already logged; ``read_jsonl`` merges records by step, later lines winning.

Texts go to ``texts.jsonl`` and hyperparameters to ``hparams.json`` next to the metrics file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbolt.utils.files import write_text_atomic
from rlbolt.loggers.interface import MetricWriter, scalar_to_float

__all__ = ["JsonlWriter", "read_jsonl"]

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _drop_torn_tail(path: Path) -> None:
    """Cuts a last line that has no newline (a write interrupted by a kill)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1  # 0 when the only line is torn
        f.truncate(keep)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    try:
        return scalar_to_float("hparam", value)
    except (TypeError, ValueError):
        return str(value)


class JsonlWriter(MetricWriter):
    """Appends one JSON object per ``write_scalars`` call to a ``.jsonl`` file.

    Args:
        path: the metrics file (conventionally ``<run_dir>/metrics.jsonl``); parent folders
            are created.
        fsync: also ``os.fsync`` every line (survives a machine crash, not just a process kill;
            slower on network filesystems).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False):
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise IsADirectoryError(
                f"JsonlWriter path {str(self.path)!r} is a directory; pass a file path such as "
                f"{str(self.path / 'metrics.jsonl')!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._failed = False
        _drop_torn_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._texts_path = self.path.with_name("texts.jsonl")
        self._texts_file = None

    def _append(self, f, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        try:
            f.write(line)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        except OSError as error:
            self._failed = True  # flush and close then drop what cannot be written: this error says it once
            if error.filename is None:  # a failed write() names no file: say which one
                raise OSError(error.errno, error.strerror, f.name) from error
            raise

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        self._check_open()
        record: dict[str, Any] = {"step": int(step)}
        for name, value in scalars.items():
            if name == "step":
                raise ValueError("metric name 'step' is reserved in metrics.jsonl; rename it")
            record[name] = _encode(scalar_to_float(name, value))
        self._append(self._file, record)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._check_open()
        if self._texts_file is None:
            _drop_torn_tail(self._texts_path)
            self._texts_file = open(self._texts_path, "a", encoding="utf-8")
        self._append(self._texts_file, {"step": int(step), **{k: str(v) for k, v in texts.items()}})

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        # Written whole and renamed into place, so a reader never sees half a file.
        write_text_atomic(self.path.with_name("hparams.json"), json.dumps(_jsonable(hparams), indent=2, sort_keys=True) + "\n")

    def flush(self) -> None:
        for f in (self._file, self._texts_file):
            if f is not None and not f.closed:
                self._unless_failed(f.flush)

    def close(self) -> None:
        for f in (self._file, self._texts_file):
            if f is not None and not f.closed:
                self._unless_failed(f.close)

    def _unless_failed(self, action) -> None:
        """After a failed append (a full disk), the buffered tail of that line cannot be written
        either: it is dropped (a resumed run cuts the torn line) instead of raising a second time."""
        try:
            action()
        except OSError:
            if not self._failed:
                raise

    def _check_open(self) -> None:
        if self._file.closed:
            raise RuntimeError(f"JsonlWriter({str(self.path)!r}) is closed; create a new writer")


def read_jsonl(path: str | os.PathLike[str], *, merge_steps: bool = True) -> list[dict[str, Any]]:
    """Reads a ``metrics.jsonl`` written by ``JsonlWriter``.

    Args:
        path: the file.
        merge_steps: merge records that share a step (a resumed run repeats steps; train and
            validation metrics of one step are separate lines), later lines winning, and sort by
            step. When False, return the lines as written.

    Returns:
        One dict per step (or per line): ``{"step": int, name: float, ...}``, with
        ``"nan"``/``"inf"``/``"-inf"`` turned back into floats.
    """
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                if not line.endswith("\n"):
                    break  # a torn last line: the writer was killed mid-write
                raise ValueError(f"{path}:{line_number} is not valid JSON: {exc}") from exc
            records.append({k: _NON_FINITE.get(v, v) if isinstance(v, str) else v
                            for k, v in raw.items()})
    if not merge_steps:
        return records
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        by_step.setdefault(record["step"], {}).update(record)
    return [by_step[step] for step in sorted(by_step)]
