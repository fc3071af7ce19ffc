"""The run directory: one folder per run, laid out the same way by every entry point.

    <run_dir>/
      config.yaml      the fully resolved config (what `rlbolt resume` rebuilds the run from)
      metrics.jsonl    one JSON line per logged step (MetricsLogger)
      checkpoints/     Orbax checkpoints (ModelCheckpoint)
      plots/           PNGs from `rlbolt plot` (reward.png at the end of the demo)
      train.log        Python logging of the run (start, per-step summaries, end)
      config_changes.jsonl  math-changing config changes allowed at a resume (and their step)
      .rlbolt.lock     the writer's OS lock (one training process per folder; see utils/runlock.py)

A fresh run refuses a folder that already holds files, so a typo never overwrites an earlier
run; `rlbolt resume` is the one way to continue into an existing folder. Opening the folder
takes its lock before anything is written, and the process keeps it until it ends.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rlbolt.callback import Callback
from rlbolt.utils import runlock
from rlbolt.utils.files import to_plain, write_text_atomic

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
CHECKPOINTS_DIR = "checkpoints"
PLOTS_DIR = "plots"

logger = logging.getLogger("rlbolt")


class RunDirError(ValueError):
    """A run directory cannot be used as asked (non-empty for a fresh run, missing for resume)."""


def check_run_dir(path: str | Path, *, resume: bool = False, allow_existing: bool = False) -> Path:
    """Checks that a run may use `path`, without creating anything (see `prepare_run_dir`).

    Raises:
      RunDirError: a fresh run into a non-empty folder or onto a file, or a resume of a folder
        that is not a run.
    """
    run_dir = Path(path)
    if resume:
        if not (run_dir / CONFIG_FILE).is_file():
            raise RunDirError(not_a_run_message(run_dir))
    elif run_dir.exists():
        if not run_dir.is_dir():
            raise RunDirError(f"run directory {run_dir} exists and is a file; choose another --run-dir")
        if not allow_existing and any(p.name != runlock.LOCK_FILE for p in run_dir.iterdir()):
            raise RunDirError(f"run directory {run_dir} is not empty; continue it with `rlbolt resume {run_dir}` "
                              "or choose a new --run-dir (nothing was overwritten)")
    return run_dir


def prepare_run_dir(path: str | Path, *, resume: bool = False, allow_existing: bool = False) -> Path:
    """Creates (or, for resume, checks) a run directory and its `checkpoints/` and `plots/`, and
    locks it for this process (`release_run_dir` when the run is over; the kernel releases it
    anyway when the process ends).

    The one place a run folder is created: every entry point checks its inputs first and calls
    this last, so a refused run leaves nothing behind. The lock is taken before anything is
    written into the folder.

    Args:
      path: the run directory.
      resume: continue an existing run: the folder must exist and hold `config.yaml`.
      allow_existing: accept a non-empty folder (a script run again continues its own run).

    Returns:
      The run directory as a Path.

    Raises:
      RunDirError: a fresh run into a non-empty folder, or a resume of a folder that is not a run.
      RunDirBusy: another process is writing into the folder (its lock names it).
    """
    run_dir = check_run_dir(path, resume=resume, allow_existing=allow_existing)
    runlock.acquire(run_dir)
    try:  # checked again under the lock: another process may have started a run there meanwhile
        check_run_dir(path, resume=resume, allow_existing=allow_existing)
    except RunDirError:
        runlock.release(run_dir)
        raise
    for sub in (CHECKPOINTS_DIR, PLOTS_DIR):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    return run_dir


def release_run_dir(run_dir: str | Path) -> None:
    """Releases the lock `prepare_run_dir` took (the kernel does it anyway when the process ends)."""
    runlock.release(run_dir)


def not_a_run_message(run_dir: Path) -> str:
    """Why `run_dir` cannot be resumed or exported by config: it has no config.yaml."""
    if (run_dir / CHECKPOINTS_DIR).is_dir():
        return (f"{run_dir} was trained from a Python script (it has checkpoints but no {CONFIG_FILE}); resume it by "
                "running that script again with the same run_dir (its ModelCheckpoint continues from the newest "
                "checkpoint); `rlbolt export` works on it")
    return (f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the folder a previous `rlbolt demo` or "
            "`rlbolt fit` wrote")


def discard_unused_run_dir(run_dir: str | Path) -> bool:
    """Removes a run folder that holds nothing of a run: no checkpoint and no logged step.

    For a fresh run that failed before its first step: leaving the folder would make the
    corrected command refuse it as "not empty" while `rlbolt resume` finds nothing to resume.

    Returns:
      True when the folder was removed.
    """
    run_dir = Path(run_dir)
    checkpoints = run_dir / CHECKPOINTS_DIR
    metrics = run_dir / METRICS_FILE
    if not run_dir.is_dir() or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        return False
    if metrics.is_file() and metrics.stat().st_size > 0:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()


def write_config(run_dir: str | Path, config: Mapping[str, Any]) -> Path:
    """Writes `config` (a `{section: {key: value}}` mapping) to `<run_dir>/config.yaml` atomically."""
    return write_text_atomic(Path(run_dir) / CONFIG_FILE, yaml.safe_dump(to_plain(config), sort_keys=False))


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """Reads `<run_dir>/config.yaml` as a dict; a missing or malformed file is a RunDirError."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise RunDirError(f"{path} does not exist; is {run_dir} a run directory?")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RunDirError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


class RunLogHandler(logging.FileHandler):
    """`train.log`'s handler: what it cannot write (the run folder's disk is full, or gone) is
    dropped, a record or, at flush and close, the buffered tail. logging's default prints "---
    Logging error ---" and a traceback to stderr for each such record (Orbax logs its failed save
    through absl while the disk is full), and a failing flush at close raised out of the command
    after its one-line report; either buried the line that reports the failure that matters."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handleError(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            pass

    def close(self) -> None:
        try:  # the file is closed even when its final flush fails (io closes the descriptor anyway)
            super().close()
        except OSError:
            pass


def attach_log_file(run_dir: str | Path, level: int = logging.INFO) -> logging.Handler:
    """Sends the `rlbolt` logger's records to `<run_dir>/train.log` (appending on resume).

    While attached, the `rlbolt` records stop propagating to the root logger (whose handlers
    libraries may have set up) and only warnings and errors reach stderr, so the terminal
    shows the progress bar rather than every log line twice. Orbax's warnings and errors
    (logged through absl) go to train.log only: a failed save is reported once, in one line.
    A record that cannot be written there (a full disk) is dropped (`RunLogHandler`).

    Returns:
      The file handler; pass it to `detach_log_file` when the run ends.
    """
    handler = RunLogHandler(Path(run_dir) / LOG_FILE, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(level)
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.addFilter(lambda record: getattr(record, "console", True))
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    library = RunLogHandler(Path(run_dir) / LOG_FILE, encoding="utf-8")
    library.setFormatter(handler.formatter)
    library.setLevel(logging.WARNING)
    absl = logging.getLogger("absl")
    handler.rlbolt_restore = (console, logger.propagate, logger.level, library, absl.propagate)  # undone by detach
    absl.addHandler(library)
    absl.propagate = False
    logger.addHandler(handler)
    logger.addHandler(console)
    logger.propagate = False
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return handler


def detach_log_file(handler: logging.Handler) -> None:
    """Flushes and closes a handler added by `attach_log_file` and restores the logger."""
    console, propagate, level, library, absl_propagate = handler.rlbolt_restore
    for h in (handler, console):
        logger.removeHandler(h)
        h.close()
    absl = logging.getLogger("absl")
    absl.removeHandler(library)
    library.close()
    logger.propagate, logger.level, absl.propagate = propagate, level, absl_propagate


class LogFile(Callback):
    """Writes a one-line summary of every n-th step (and the start, end, failures) to the log.

    Args:
      every_n_steps: log a step line when `step % every_n_steps == 0`.
      keys: the metrics shown on each line, when present.
    """

    KEYS = ("reward/mean", "loss", "grad_norm", "response_length/mean", "time/step")
    writes_run_dir = True

    def __init__(self, every_n_steps: int = 10, keys: tuple[str, ...] = KEYS):
        self.every_n_steps, self.keys = every_n_steps, keys
        self.log = logging.getLogger("rlbolt.run")

    def on_fit_start(self, run, state) -> None:
        self.log.info("fit starts at step %d: %s, max_steps=%s, run_dir=%s", state.step, run.plan,
                      run.max_steps, run.run_dir)
        self.log.info("trainable parameters:\n%s", parameter_table(state.params))

    def on_step_end(self, run, info) -> None:
        if info.step % self.every_n_steps == 0 or info.is_last:
            shown = " ".join(f"{k}={_fmt(info.metrics[k])}" for k in self.keys if k in info.metrics)
            self.log.info("step %d %s", info.step, shown)

    def on_validation_end(self, run, step: int, metrics: dict[str, float]) -> None:
        self.log.info("validation at step %d: %s", step, " ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())))

    def on_fit_end(self, run, state) -> None:
        if run.control.interrupted:
            name = signal.Signals(run.control.stop_signal).name if run.control.stop_signal else "an interrupt"
            self.log.info("fit interrupted by %s after step %d (policy version %d)", name, state.step, state.policy_version)
        else:
            self.log.info("fit ended after step %d (policy version %d)", state.step, state.policy_version)

    def on_exception(self, run, exc: BaseException) -> None:
        # The command reports the error itself, in one line: this record goes to train.log only.
        self.log.error("fit stopped: %s: %s", type(exc).__name__, exc, extra={"console": False})


def parameter_table(params: Any) -> str:
    """A table of every trainable array (name, shape, dtype, size) and the total, via CLU.

    Args:
      params: any pytree of arrays (nnx.State, nested dicts, PPO's {"policy", "value_head"}).

    Returns:
      The table text; names are the pytree paths joined with "/".
    """
    import jax
    from clu import parameter_overview

    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if len(names) > 1 and names[-1] == "value":  # an nnx Variable's own field, not a name
            names.pop()
        flat["/".join(names) or "params"] = leaf
    return parameter_overview.get_parameter_overview(flat, include_stats=False)


def _fmt(value: float) -> str:
    value = float(value)
    return f"{value:.4g}" if math.isfinite(value) else str(value)
