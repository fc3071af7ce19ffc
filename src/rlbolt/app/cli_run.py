"""What `rlbolt demo`, `rlbolt fit` and `rlbolt resume` do, as functions the CLI and tests call.

Every run goes through the same steps: prepare the run directory (refusing a non-empty one
unless resuming, and locking it for this process), write the resolved config, log to train.log,
fit with MetricsLogger(jsonl), TimelineLogger, ProgressBar and ModelCheckpoint, then draw the
plots and print a summary. A fit stopped by SIGINT/SIGTERM raises `RunInterrupted` after its
checkpoint is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rlbolt.app import rundir
from rlbolt.app.cli_export import demo_module
from rlbolt.demo.config import DemoConfig
from rlbolt.demo.digits import demo_rows
from rlbolt.callback import Callback
from rlbolt.checkpointing import CheckpointWriteError
from rlbolt.fit_checks import check_fit
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer
from rlbolt.utils.files import exception_chain, format_size, is_disk_full

log = logging.getLogger("rlbolt.run")


DEMO_TARGET = 0.9  # the reward the demo's summary reports reaching


class RunInterrupted(Exception):
    """A run stopped by SIGINT or SIGTERM after its last completed step was saved.

    Attributes:
      signum: the signal.
      step: the last completed step.
      checkpoint_step: the newest checkpoint on disk (None when checkpointing was off).
      run_dir: the run directory.
    """

    def __init__(self, signum: int, step: int, checkpoint_step: int | None, run_dir: Path):
        self.signum, self.step, self.checkpoint_step, self.run_dir = signum, step, checkpoint_step, run_dir
        saved = (f"checkpoint of step {checkpoint_step} saved" if checkpoint_step is not None
                 else "no checkpoint (checkpointing is off)")
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}; {saved}; "
                         f"continue with: rlbolt resume {run_dir}")

    @property
    def exit_code(self) -> int:
        """128 + signum: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


class RunDiskFull(OSError):
    """The disk filled up while a run wrote its files (metrics.jsonl, train.log, plots, texts):
    one line saying which file, the free space, the finished checkpoints (intact) and how to go
    on. A checkpoint that cannot be written raises `CheckpointWriteError` instead."""

    def __init__(self, error: BaseException, run_dir: Path):
        where = next((e.filename for e in exception_chain(error) if isinstance(e, OSError) and e.filename), None)
        try:
            free = f"free {format_size(shutil.disk_usage(run_dir).free)}"
        except OSError:
            free = "free space unknown"
        kept = _finished_checkpoints(run_dir)
        super().__init__(errno.ENOSPC, f"could not write {where or f'to {run_dir}'}: no space left on device ({free}); "
                         f"finished checkpoints: {kept or 'none'}, intact; free space, then continue with: "
                         f"rlbolt resume {run_dir}")

    def __str__(self) -> str:
        return self.strerror


def _finished_checkpoints(run_dir: Path) -> list[int]:
    folder = run_dir / rundir.CHECKPOINTS_DIR
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


class ResumeNotice(Callback):
    """Says on the console which step a resumed run continues from (train.log has it too)."""

    def __init__(self, out: TextIO | None = None):
        self.out = out

    def on_fit_start(self, trainer, state) -> None:
        if state.step == 0:
            return
        line = f"resumed from the checkpoint of step {state.step} in {Path(trainer.run_dir) / rundir.CHECKPOINTS_DIR}"
        if trainer.max_steps is not None and state.step >= trainer.max_steps:
            line += f"; the run already reached max_steps={trainer.max_steps}: nothing to train (raise it with --max-steps)"
        print(line, file=self.out or sys.stdout, flush=True)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What a finished run reports.

    Attributes:
      run_dir: the run directory.
      steps: global steps completed.
      seconds: wall time of this invocation (start-up and compilation included).
      start_reward: reward/mean of the first logged step (the same after any resume).
      end_reward: mean reward/mean over the last (up to 5) logged steps.
      first_step_at_target: first step whose reward/mean reached `target`, or None.
      target: the reward level the summary reports reaching (the demo's 0.9), or None.
      plots: the PNGs written.
    """

    run_dir: Path
    steps: int
    seconds: float
    start_reward: float | None
    end_reward: float | None
    first_step_at_target: int | None
    target: float | None
    plots: tuple[Path, ...]

    def text(self) -> str:
        """A few human lines for the terminal."""
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
        reached = ""
        if self.target is not None:
            reached = (f" (first reached {self.target} at step {self.first_step_at_target})"
                       if self.first_step_at_target is not None else f" (did not reach {self.target})")
        return "\n".join([
            f"done: {self.steps} steps in {self.seconds / 60:.1f} min ({self.seconds:.0f} s, compilation included)",
            f"reward: {fmt(self.start_reward)} at the start -> {fmt(self.end_reward)} at the end{reached}",
            f"run directory: {self.run_dir}",
            *(f"plot: {p}" for p in self.plots),
        ])


def standard_callbacks(checkpoint_every: int | None, *, progress: bool = True, config: dict | None = None,
                       allow_config_change: bool = False) -> list:
    """MetricsLogger(jsonl), TimelineLogger, ProgressBar, ModelCheckpoint (resuming the latest, recording
    `config`), LogFile and ResumeNotice."""
    from rlbolt.callbacks.checkpoint import ModelCheckpoint
    from rlbolt.callbacks.metrics import MetricsLogger
    from rlbolt.callbacks.progress import ProgressBar
    from rlbolt.callbacks.timeline import TimelineLogger

    callbacks: list[Any] = [MetricsLogger(writer=["jsonl"]), TimelineLogger()]
    if progress:
        callbacks.append(ProgressBar())
    callbacks.append(ModelCheckpoint(every_n_steps=checkpoint_every, keep=2, resume="latest", config=config,
                                     allow_config_change=allow_config_change))
    return [*callbacks, rundir.LogFile(), ResumeNotice()]


def run_demo(config: DemoConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
             out: TextIO | None = None, allow_config_change: bool = False) -> RunSummary:
    """Trains the built-in demo (see `rlbolt.demo`) into `run_dir`.

    Args:
      config: the demo settings; unset ones take the task's defaults (`DemoConfig.resolved`), and
        config.yaml records the resolved values.
      run_dir: the run directory; must be empty or absent unless `resume`.
      resume: continue from the latest checkpoint in `run_dir` (config.yaml must exist).
      progress: show the progress bar.
      out: where the summary is printed (default stdout).
      allow_config_change: resume even if a math-changing setting differs from the checkpoint's.

    Returns:
      The RunSummary (also printed and logged).

    Raises:
      RunInterrupted: SIGINT/SIGTERM stopped the run (its last step is saved).
    """
    config = config.resolved()  # the task's defaults where a field is unset; config.yaml records them
    rundir.check_run_dir(run_dir, resume=resume)
    if resume:
        _require_checkpoints(Path(run_dir))
    callbacks = standard_callbacks(config.checkpoint_every, progress=progress, config=config.to_dict(),
                                   allow_config_change=allow_config_change)
    trainer = Trainer(BatchPlan(config.prompts_per_step, config.num_generations), max_steps=config.max_steps,
                      seed=config.seed, callbacks=callbacks, run_dir=run_dir)
    module, rows = demo_module(config), demo_rows(config)
    trainer.plan = check_fit(trainer.plan, module, rows, None)
    with _opened_run_dir(run_dir, resume) as path:
        if _main_process():
            rundir.write_config(path, config.to_dict())
        return _fit_and_report(trainer, module, rows, None, path, out, target=DEMO_TARGET)


def run_config(cfg: Any, *, resume: bool = False, out: TextIO | None = None,
               allow_config_change: bool = False) -> RunSummary:
    """Trains a recipe config (a resolved `rlbolt.config.RunConfig`) into `cfg.trainer.run_dir`.

    Everything that can be checked is checked before the run folder is created (see
    `rlbolt.app.build.assemble_run`); a fresh run that fails before its first step removes
    the folder again.

    Args:
      cfg: the run config; `trainer.run_dir` must be set.
      resume: continue from the latest checkpoint of that directory.
      out: where the summary is printed (default stdout).
      allow_config_change: resume even if a math-changing setting differs from the checkpoint's.

    Returns:
      The RunSummary.

    Raises:
      RunInterrupted: SIGINT/SIGTERM stopped the run (its last step is saved).
    """
    from rlbolt.app.build import assemble_run, start_distributed
    from rlbolt.config import save_config
    from rlbolt.callbacks.checkpoint import ModelCheckpoint

    if start_distributed(cfg):  # before anything touches a device; every process runs this command
        cfg = _same_run_dir(cfg)
    _on_process_0(lambda: rundir.check_run_dir(cfg.trainer.run_dir, resume=resume))
    if resume:
        _require_checkpoints(Path(cfg.trainer.run_dir))
    run = assemble_run(cfg, callbacks=[rundir.LogFile(), ResumeNotice()])
    for checkpoint in run.trainer.callbacks.find(ModelCheckpoint):
        checkpoint.allow_config_change = allow_config_change
    with _opened_run_dir(cfg.trainer.run_dir, resume) as path:
        if _main_process():
            save_config(run.config, path / rundir.CONFIG_FILE)
        return _fit_and_report(run.trainer, run.module, run.train_rows, run.val_rows, path, out)


@contextlib.contextmanager
def _opened_run_dir(run_dir: str | Path, resume: bool):
    """Creates and locks the run folder; a fresh run that fails before its first step leaves none
    behind, and the lock is released when the run is over. With several processes process 0
    alone creates (and removes) it."""
    existed = Path(run_dir).exists()
    _on_process_0(lambda: rundir.prepare_run_dir(run_dir, resume=resume))
    path = Path(run_dir)
    try:
        yield path
    except BaseException:
        if _main_process() and not resume and rundir.discard_unused_run_dir(path) and existed:
            path.mkdir()  # the user's empty folder stays, empty
        raise
    finally:
        rundir.release_run_dir(path)


def _on_process_0(action) -> None:
    """Runs a run-folder `action` on process 0 only; its RunDirError is raised on every process
    (several processes checking and creating one shared folder would race)."""
    import jax

    if jax.process_count() == 1:
        action()
        return
    from rlbolt.distributed import gather_objects

    error = None
    if jax.process_index() == 0:
        try:
            action()
        except rundir.RunDirError as exc:
            error = str(exc)
    error = gather_objects(error)[0]  # also a barrier: nobody goes on before process 0 is done
    if error is not None:
        raise rundir.RunDirError(error)


def _same_run_dir(cfg: Any) -> Any:
    """Process 0's run directory on every process (a default name holds the start time)."""
    from rlbolt.distributed import gather_objects

    run_dir = gather_objects(cfg.trainer.run_dir)[0]
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=run_dir))


def _main_process() -> bool:
    import jax

    return jax.process_index() == 0


def _require_checkpoints(run_dir: Path) -> None:
    """A resume never starts over from step 0: the run must have a checkpoint (ModelCheckpoint
    then refuses a folder whose checkpoints were all deleted, naming the first one saved)."""
    folder = run_dir / rundir.CHECKPOINTS_DIR
    entries = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    if not any(name.split(".")[0].isdigit() for name in entries) and "saved.json" not in entries:
        raise rundir.RunDirError(f"{folder} holds no checkpoint to resume from: the run ended before its first one "
                                 "was written; start it again in a new run directory")


def _fit_and_report(trainer: Trainer, module: Any, train_rows: Any, val_rows: Any, run_dir: Path,
                    out: TextIO | None, target: float | None = None) -> RunSummary:
    main = _main_process()  # only process 0 writes train.log, plots and the summary
    handler = rundir.attach_log_file(run_dir) if main else None
    started = time.perf_counter()
    try:
        state = trainer.fit(module, train_rows, val_rows)
        if trainer.interrupted:
            saved = [cb.saved_step for cb in trainer.callbacks if cb.saved_step is not None]
            raise RunInterrupted(trainer.stop_signal or signal.SIGINT, state.step, max(saved, default=None), run_dir)
        if not main:
            return RunSummary(run_dir, state.step, time.perf_counter() - started, None, None, None, target, ())
        summary = summarize(run_dir, state.step, time.perf_counter() - started, target)
        log.info("summary:\n%s", summary.text())
    except Exception as error:
        if is_disk_full(error) and not isinstance(error, CheckpointWriteError):  # one line, like a checkpoint's
            raise RunDiskFull(error, run_dir) from error
        raise
    finally:
        if handler is not None:
            rundir.detach_log_file(handler)
    print(summary.text(), file=out or sys.stdout, flush=True)
    return summary


def summarize(run_dir: Path, steps: int, seconds: float, target: float | None = None) -> RunSummary:
    """Reads metrics.jsonl, draws the plots, and condenses the reward curve.

    Args:
      run_dir: the run directory.
      steps: global steps completed.
      seconds: wall time of this invocation.
      target: a reward level to report the first step reaching (None: not reported).
    """
    from rlbolt.app.plotting import load_metrics, plot_metrics, series

    metrics_path = run_dir / rundir.METRICS_FILE
    if not metrics_path.is_file():
        return RunSummary(run_dir, steps, seconds, None, None, None, target, ())
    plots = plot_metrics(metrics_path, run_dir / rundir.PLOTS_DIR)
    reward_steps, rewards = series(load_metrics(metrics_path), "reward/mean")
    tail = rewards[-5:]
    hit = [int(s) for s, r in zip(reward_steps, rewards) if target is not None and r >= target]
    return RunSummary(run_dir, steps, seconds, float(rewards[0]) if len(rewards) else None,
                      float(tail.mean()) if len(tail) else None, hit[0] if hit else None, target,
                      tuple(plots.values()))
