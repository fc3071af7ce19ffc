"""MetricsLogger: sends each step's metrics, validation metrics and hparams to metric writers."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlbolt.callback import Callback, Periodic
from rlbolt.loggers import MultiWriter, NullWriter, create_default_writer, namespaced
from rlbolt.run_info import RunInfo

__all__ = ["MetricsLogger", "WRITER_NAMES"]

WRITER_NAMES = ("console", "jsonl", "tensorboard", "wandb")


class MetricsLogger(Callback):
    """Writes ``StepInfo.metrics`` (and ``val/*`` metrics) through metric writers, on process 0.

    Named writers are built at ``on_fit_start`` by ``create_default_writer`` under
    ``run.run_dir``: ``metrics.jsonl``, ``tensorboard/``, ``wandb/``. They are closed at ``on_fit_end`` and on an exception, so what
    was logged before a crash is on disk. Names go through ``rlbolt.loggers.namespaced``
    (lowercase, ``/``-separated); a bad name fails at the first step that logs it.

    Resume needs no state: ``metrics.jsonl`` is appended to, and ``read_jsonl`` merges steps a
    resumed run logs again.

    Args:
        writer: ``None`` (``["console", "jsonl"]``), a list whose items are writer names from
            ``WRITER_NAMES`` or writer objects, or one writer object (rlbolt's or CLU's).
        every_n_steps: log train metrics when ``step % every_n_steps == 0``; the last step
            (``StepInfo.is_last``: ``max_steps`` reached or the epochs' prompts used up) is always logged. Validation metrics are always logged.
        every_secs: also log when this many seconds passed since the last logged step.
        hparams: what ``write_hparams`` records at fit start; ``None`` collects the run's
            settings, the BatchPlan and the module card's ``hparams`` (``RLModule.card()``).
        wandb_project: the W&B project, when ``"wandb"`` is among the writer names.
        clock: seconds source for ``every_secs`` (injectable for tests).
    """

    def __init__(self, writer: Any = None, every_n_steps: int | None = 1, *,
                 every_secs: float | None = None, hparams: Mapping[str, Any] | None = None,
                 wandb_project: str | None = None, clock: Callable[[], float] = time.monotonic):
        self._spec = ["console", "jsonl"] if writer is None else writer
        if isinstance(self._spec, str):
            raise TypeError(f"MetricsLogger writer={writer!r}: pass a list of names, e.g. writer=[{writer!r}]")
        items = self._spec if isinstance(self._spec, (list, tuple)) else [self._spec]
        for item in items:
            if isinstance(item, str) and item not in WRITER_NAMES:
                raise ValueError(f"MetricsLogger writer name {item!r} is unknown; use one of {WRITER_NAMES}")
            if not isinstance(item, str) and not hasattr(item, "write_scalars"):
                raise TypeError(f"MetricsLogger writer item {item!r} is neither a writer name nor a "
                                "MetricWriter (an object with write_scalars/write_hparams/flush/close)")
        self.periodic = Periodic(every_n_steps=every_n_steps, every_secs=every_secs, clock=clock)
        self.hparams = hparams
        self.wandb_project = wandb_project
        self.writer: Any = None

    @property
    def writes_run_dir(self) -> bool:
        """True when a named file writer (jsonl, tensorboard, wandb) writes under the run directory."""
        return isinstance(self._spec, (list, tuple)) and any(isinstance(i, str) and i != "console" for i in self._spec)

    # -- hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, run: RunInfo, state) -> None:
        if not run.is_main_process:
            self.writer = NullWriter()
            return
        self.writer = self._build(run)
        hparams = self.hparams if self.hparams is not None else collect_hparams(run)
        self.writer.write_hparams(dict(hparams))

    def on_step_end(self, run: RunInfo, info) -> None:
        if self.periodic.should_fire(info.step) or info.is_last:
            if info.is_last:
                self.periodic.fired(info.step)
            self.writer.write_scalars(info.step, namespaced(info.metrics))

    def on_validation_end(self, run: RunInfo, step: int, metrics: dict[str, float]) -> None:
        self.writer.write_scalars(step, namespaced({k if k.startswith("val/") else f"val/{k}": v
                                                    for k, v in metrics.items()}))

    def on_fit_end(self, run: RunInfo, state) -> None:
        self._close()

    def on_exception(self, run: RunInfo, exc: BaseException) -> None:
        self._close()

    # -- helpers ----------------------------------------------------------------------------------
    def _build(self, run: RunInfo) -> Any:
        if not isinstance(self._spec, (list, tuple)):
            return self._spec
        names = {item for item in self._spec if isinstance(item, str)}
        objects = [item for item in self._spec if not isinstance(item, str)]
        if not names:
            return MultiWriter(objects)
        # One place (create_default_writer) owns the run-folder layout; this is process 0.
        built = create_default_writer(run.run_dir, console="console" in names, jsonl="jsonl" in names,
                                      tensorboard="tensorboard" in names, wandb="wandb" in names,
                                      wandb_project=self.wandb_project, process_index=0)
        return MultiWriter([built, *objects])

    def _close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()


def collect_hparams(run: RunInfo) -> dict[str, Any]:
    """The run settings a dashboard should show: trainer settings, the BatchPlan, the card's hparams.

    Args:
        run: the run's description.

    Returns:
        A nested dict: ``{"trainer": {...}, "plan": {...}, "module": name, "module_hparams": {...}}``.
    """
    fields = ("max_steps", "max_epochs", "seed", "data_seed", "mode", "max_staleness", "val_every_n_steps")
    out: dict[str, Any] = {"trainer": {f: run.settings[f] for f in fields if f in run.settings}}
    if dataclasses.is_dataclass(run.plan):
        out["plan"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(run.plan).items()}
    if run.module is not None:
        out["module"] = type(run.module).__name__
        if run.card is not None and isinstance(run.card.hparams, Mapping):
            out["module_hparams"] = dict(run.card.hparams)
    return out
