"""``WandbWriter``: Weights & Biases runs, online or offline (``WANDB_MODE=offline``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlbolt.loggers.interface import MetricWriter, scalar_to_float

__all__ = ["WandbWriter"]


class WandbWriter(MetricWriter):
    """Logs to one W&B run, created when the writer is built.

    The run's local files go under ``<run_dir>/wandb/``. Offline runs (``mode="offline"`` or the
    environment variable ``WANDB_MODE=offline``) need no network or account; upload them later
    with ``wandb sync <run_dir>/wandb/offline-run-*``.

    W&B keeps one history row per step and drops values for a step lower than one it has
    already seen, so on resume (``run_id=...``) steps logged before the kill are not re-logged.

    Args:
        project: the W&B project (``None``: wandb's default / ``WANDB_PROJECT``).
        run_dir: the training run's folder; created if missing.
        config: hyperparameters recorded at init (nested mappings are kept nested).
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; ``None`` lets ``WANDB_MODE`` decide.
        name: the run's display name.
        run_id: a stable id to resume an earlier W&B run (``resume="allow"`` is then passed).
        **init_kwargs: passed on to ``wandb.init`` (for example ``entity``, ``tags``, ``group``).
    """

    def __init__(self, project: str | None = None, run_dir: str | os.PathLike[str] = ".",
                 config: Mapping[str, Any] | None = None, mode: str | None = None, *,
                 name: str | None = None, run_id: str | None = None, **init_kwargs: Any):
        try:
            import wandb
        except ImportError as exc:  # pragma: no cover - wandb is a dependency
            raise ImportError("WandbWriter needs wandb: pip install wandb") from exc
        if mode is not None and mode not in ("online", "offline", "disabled"):
            raise ValueError(f"WandbWriter mode={mode!r}; use 'online', 'offline', 'disabled' or None")
        self.run_dir = os.fspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        if run_id is not None:
            init_kwargs.setdefault("id", run_id)
            init_kwargs.setdefault("resume", "allow")
        self._run = wandb.init(project=project, dir=self.run_dir,
                               config=dict(config) if config is not None else None,
                               mode=mode, name=name, **init_kwargs)
        self._closed = False

    @property
    def run(self) -> Any:
        """The underlying ``wandb.Run`` (for features this interface does not cover)."""
        return self._run

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        self._check_open()
        values = {name: scalar_to_float(name, value) for name, value in scalars.items()}
        self._run.log(values, step=int(step))

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._check_open()
        self._run.log({name: str(text) for name, text in texts.items()}, step=int(step))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._check_open()
        self._run.config.update(dict(hparams), allow_val_change=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("WandbWriter is closed (its run finished); create a new writer")
