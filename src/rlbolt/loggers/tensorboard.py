"""``TensorBoardWriter``: TensorBoard event files through tensorboardX (no TensorFlow)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlbolt.loggers.interface import MetricWriter, flatten_hparams, scalar_to_float

__all__ = ["TensorBoardWriter"]


class TensorBoardWriter(MetricWriter):
    """Writes scalars, texts and hyperparameters to TensorBoard event files in ``logdir``.

    Each metric becomes a scalar tag of the same name (``reward/mean`` shows under the
    ``reward`` section). Hyperparameters go to the HParams plugin (flattened to dotted keys) and,
    for reading at a glance, to a markdown table under the text tag ``hparams``.

    Args:
        logdir: the event-file folder (conventionally ``<run_dir>/tensorboard``); created.
        flush_secs: how often tensorboardX's background thread flushes on its own.
    """

    def __init__(self, logdir: str | os.PathLike[str], *, flush_secs: float = 10.0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:  # pragma: no cover - tensorboardX is a dependency
            raise ImportError("TensorBoardWriter needs tensorboardX: pip install tensorboardX") from exc
        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self._writer = SummaryWriter(logdir=self.logdir, flush_secs=flush_secs)
        self._closed = False

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        self._check_open()
        for name, value in scalars.items():
            self._writer.add_scalar(name, scalar_to_float(name, value), global_step=int(step))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._check_open()
        for name, text in texts.items():
            self._writer.add_text(name, str(text), global_step=int(step))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._check_open()
        from tensorboardX.summary import hparams as hparams_summary

        flat = flatten_hparams(hparams)
        # Written into this run's own event file (tensorboardX's add_hparams would open a
        # second run folder named by wall time).
        for summary in hparams_summary(flat, {}):
            self._writer.file_writer.add_summary(summary)
        table = "| name | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in flat.items())
        self._writer.add_text("hparams", table, global_step=0)

    def flush(self) -> None:
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"TensorBoardWriter({self.logdir!r}) is closed; create a new writer")
