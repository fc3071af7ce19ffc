"""What `rlbolt demo`, `rlbolt fit` and `rlbolt resume` do, as functions the CLI and tests call.

Every run goes through the same steps: prepare the run directory (refusing a non-empty one
unless resuming), write the resolved config, log to train.log, fit with MetricsLogger(jsonl),
TimelineLogger, ProgressBar and ModelCheckpoint, then draw the plots and print a summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rlbolt.app import rundir
from rlbolt.app.demo import DemoConfig, DigitsGRPO, demo_rows
from rlbolt.fit_checks import check_fit
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

log = logging.getLogger("rlbolt.run")


DEMO_TARGET = 0.9  # the reward the demo's summary reports reaching


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


def standard_callbacks(checkpoint_every: int | None, *, progress: bool = True) -> list:
    """MetricsLogger(jsonl), TimelineLogger, ProgressBar, ModelCheckpoint (resuming the latest) and LogFile."""
    from rlbolt.callbacks.checkpoint import ModelCheckpoint
    from rlbolt.callbacks.metrics import MetricsLogger
    from rlbolt.callbacks.progress import ProgressBar
    from rlbolt.callbacks.timeline import TimelineLogger

    callbacks: list[Any] = [MetricsLogger(writer=["jsonl"]), TimelineLogger()]
    if progress:
        callbacks.append(ProgressBar())
    callbacks.append(ModelCheckpoint(every_n_steps=checkpoint_every, keep=2, resume="latest"))
    return [*callbacks, rundir.LogFile()]


def run_demo(config: DemoConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
             out: TextIO | None = None) -> RunSummary:
    """Trains the built-in demo (see `rlbolt.app.demo`) into `run_dir`.

    Args:
      config: the demo settings (written to config.yaml).
      run_dir: the run directory; must be empty or absent unless `resume`.
      resume: continue from the latest checkpoint in `run_dir` (config.yaml must exist).
      progress: show the progress bar.
      out: where the summary is printed (default stdout).

    Returns:
      The RunSummary (also printed and logged).
    """
    rundir.check_run_dir(run_dir, resume=resume)
    if resume:
        _require_checkpoints(Path(run_dir))
    trainer = Trainer(BatchPlan(config.prompts_per_step, config.num_generations), max_steps=config.max_steps,
                      seed=config.seed, callbacks=standard_callbacks(config.checkpoint_every, progress=progress),
                      run_dir=run_dir)
    module, rows = DigitsGRPO(config), demo_rows(config)
    trainer.plan = check_fit(trainer.plan, module, rows, None)
    with _opened_run_dir(run_dir, resume) as path:
        rundir.write_config(path, config.to_dict())
        return _fit_and_report(trainer, module, rows, None, path, out, target=DEMO_TARGET)


def run_config(cfg: Any, *, resume: bool = False, out: TextIO | None = None) -> RunSummary:
    """Trains a recipe config (a resolved `rlbolt.app.config.RunConfig`) into `cfg.trainer.run_dir`.

    Everything that can be checked is checked before the run folder is created (see
    `rlbolt.app.build.assemble_run`); a fresh run that fails before its first step removes
    the folder again.

    Args:
      cfg: the run config; `trainer.run_dir` must be set.
      resume: continue from the latest checkpoint of that directory.
      out: where the summary is printed (default stdout).

    Returns:
      The RunSummary.
    """
    from rlbolt.app.build import assemble_run
    from rlbolt.app.config import save_config

    rundir.check_run_dir(cfg.trainer.run_dir, resume=resume)
    if resume:
        _require_checkpoints(Path(cfg.trainer.run_dir))
    run = assemble_run(cfg, callbacks=[rundir.LogFile()])
    with _opened_run_dir(cfg.trainer.run_dir, resume) as path:
        save_config(run.config, path / rundir.CONFIG_FILE)
        return _fit_and_report(run.trainer, run.module, run.train_rows, run.val_rows, path, out)


@contextlib.contextmanager
def _opened_run_dir(run_dir: str | Path, resume: bool):
    """Creates the run folder; a fresh run that fails before its first step leaves none behind."""
    existed = Path(run_dir).exists()
    path = rundir.prepare_run_dir(run_dir, resume=resume)
    try:
        yield path
    except BaseException:
        if not resume and rundir.discard_unused_run_dir(path) and existed:
            path.mkdir()  # the user's empty folder stays, empty
        raise


def _require_checkpoints(run_dir: Path) -> None:
    folder = run_dir / rundir.CHECKPOINTS_DIR
    steps = [p for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    if not steps:
        raise rundir.RunDirError(f"{folder} holds no checkpoint to resume from; train with checkpoints "
                                 "(`rlbolt demo --checkpoint-every K`, or callbacks.checkpoint_every_n_steps for fit)")


def _fit_and_report(trainer: Trainer, module: Any, train_rows: Any, val_rows: Any, run_dir: Path,
                    out: TextIO | None, target: float | None = None) -> RunSummary:
    handler = rundir.attach_log_file(run_dir)
    started = time.perf_counter()
    try:
        state = trainer.fit(module, train_rows, val_rows)
        summary = summarize(run_dir, state.step, time.perf_counter() - started, target)
        log.info("summary:\n%s", summary.text())
    finally:
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
