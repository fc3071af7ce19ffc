"""``create_default_writer``: the writer a run gets unless it builds its own."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbolt.loggers.async_writer import AsyncWriter
from rlbolt.loggers.console import ConsoleWriter
from rlbolt.loggers.interface import MetricWriter, MultiWriter, NullWriter
from rlbolt.loggers.jsonl import JsonlWriter
from rlbolt.loggers.tensorboard import TensorBoardWriter
from rlbolt.loggers.wandb_writer import WandbWriter

__all__ = ["create_default_writer"]


def _process_index() -> int:
    import jax

    return jax.process_index()


def create_default_writer(run_dir: str | os.PathLike[str], *, console: bool = True,
                          jsonl: bool = True, tensorboard: bool = False, wandb: bool = False,
                          wandb_project: str | None = None,
                          wandb_config: Mapping[str, Any] | None = None,
                          process_index: int | None = None,
                          asynchronous: bool = False) -> MetricWriter:
    """Builds the usual writers for a run folder; only process 0 writes anything.

    Layout: ``<run_dir>/metrics.jsonl``, ``<run_dir>/tensorboard/``, ``<run_dir>/wandb/``.

    Args:
        run_dir: the run's folder (created on process 0).
        console: print a compact line per step (``ConsoleWriter``).
        jsonl: append to ``metrics.jsonl`` (``JsonlWriter``).
        tensorboard: write TensorBoard event files (``TensorBoardWriter``).
        wandb: log to Weights & Biases (``WandbWriter``; ``WANDB_MODE`` picks online/offline).
        wandb_project: the W&B project.
        wandb_config: hyperparameters given to ``wandb.init``.
        process_index: this process's index; ``None`` asks ``jax.process_index()``. Processes
            other than 0 get a ``NullWriter`` and touch no files.
        asynchronous: run the file/network writers on a background thread (``AsyncWriter``);
            the console writer stays synchronous so its lines interleave with other output.

    Returns:
        One writer (a ``MultiWriter`` over the chosen ones, or a ``NullWriter``).
    """
    index = _process_index() if process_index is None else int(process_index)
    if index != 0:
        return NullWriter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    backends: list[MetricWriter] = []
    if jsonl:
        backends.append(JsonlWriter(run_dir / "metrics.jsonl"))
    if tensorboard:
        backends.append(TensorBoardWriter(run_dir / "tensorboard"))
    if wandb:
        backends.append(WandbWriter(project=wandb_project, run_dir=run_dir, config=wandb_config))
    if asynchronous and backends:
        backends = [AsyncWriter(MultiWriter(backends))]
    writers: list[MetricWriter] = [ConsoleWriter()] if console else []
    return MultiWriter(writers + backends)
