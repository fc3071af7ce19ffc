"""ModelCheckpoint: periodic Orbax checkpoints, keep-k (+ best by a metric), and exact resume.

A checkpoint of step s holds everything the run needs to continue as if it never stopped:

- arrays: params, optimizer state, the base RNG key (every rollout key derives from it and the step);
- counters: step, policy version, and the data position *as consumed by training*: a resumed
  producer starts reading there, so prompts the killed run had prefetched are produced again
  with the same keys and weights, and no rollout of a trained step is redone;
- the producer's settings (mode, lag) and, in async mode, the retained weights it will still
  roll out with (steps s - lag .. s - 1);
- every callback's `state_dict()`;
- what identifies the module's frozen params, when it has some (`RLModule.frozen_identity`: a
  LoRA run's base folder and a fingerprint of its weights): a resume against another base is
  refused (`FrozenParamsMismatch`), since the saved adapters mean nothing on top of it;
- the run's resolved config (a resume that changes a math-changing field is refused unless
  allowed, `config_guard.py`) and the model's description (export needs no module);
- a checksum of every array (`checkpoint_integrity.py`).

When to save (`every_n_steps`, `every_secs`, always at fit end, including a fit stopped by
SIGINT/SIGTERM) is a `Periodic`; what is saved lives in `checkpoint_meta.py` and how it is
written and read back in `checkpoint_io.py`. A resume uses the newest step that passes every
check (a damaged newer one is reported and moved aside); a directory that had checkpoints and
has none left is refused rather than restarted from step 0.

Order: `order = 10` runs ModelCheckpoint after the metric writers and NaNGuard (order <= 0),
whatever the list order, so step s's checkpoint only exists once step s has been logged and
checked. Restoring happens in the `on_restore` hook, before any callback's `on_fit_start`: it returns
a `Restore` (the state, every callback's state, the retained weights) that the Trainer applies, so
callbacks must not reset their state in `on_fit_start`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from rlbolt.callback import Callback, Periodic
from rlbolt.run_info import Restore, RunInfo
from rlbolt.checkpointing import config_guard, meta as checkpoint_meta
from rlbolt.checkpointing.meta import FrozenParamsMismatch, check_frozen_identity  # noqa: F401 - re-exported
from rlbolt.checkpointing.io import CheckpointIO, NoUsableCheckpoint, read_json, write_json_atomic
from rlbolt.state import StepInfo, TrainState

log = logging.getLogger(__name__)
FORMAT_VERSION = checkpoint_meta.FORMAT_VERSION
BEST_FILE = "best.json"


class ModelCheckpoint(Callback):
    """Saves checkpoints with Orbax and restores the latest (or a named) one when fit starts.

    Args:
      directory: where checkpoints go (default `<run.run_dir>/checkpoints`).
      every_n_steps: save when `steps completed % every_n_steps == 0`.
      every_secs: save when this many seconds passed since the last save.
      keep: how many of the newest checkpoints to keep (None: all). The best one (by
        `best_metric`) is kept in addition.
      best_metric: a metric name from `on_validation_end` (e.g. "val/accuracy"); the step with
        the best value is kept (and saved if no periodic save covered it).
      best_mode: "max" or "min" for `best_metric`.
      async_save: write on a background thread (training continues during the write).
      resume: "latest" (the newest usable checkpoint), a step number, or None (never restore;
        then the directory must hold no checkpoints, so a run never silently overwrites another).
      save_on_exception: when fit stops on an exception, save the last completed step (a fit
        stopped by SIGINT/SIGTERM ends normally, and its last step is always saved). On one
        process only: across processes a save needs all of them, and an exception may have
        stopped one alone; a stop they agree on, such as NaNGuard's, saves by itself.
      config: the run's resolved config to record in every checkpoint (the `rlbolt` command passes
        config.yaml's content); None records the Trainer's settings, the plan and the module's
        class and `hparams`.
      allow_config_change: resume even when a math-changing config field differs from the
        checkpoint's (the change is recorded in `<run_dir>/config_changes.jsonl`).
      clock: seconds clock for `every_secs` (injectable for tests).

    Attributes:
      restored_step: the step restored by the last `fit` (None when it started fresh).
      saved_step: the newest step this fit saved (or restored), None before any.
    """

    order = 10  # saves after the step's metrics are written
    writes_run_dir = True

    def __init__(self, directory: str | Path | None = None, every_n_steps: int | None = None,
                 every_secs: float | None = None, keep: int | None = 3, best_metric: str | None = None,
                 best_mode: str = "max", async_save: bool = True, resume: str | int | None = "latest",
                 save_on_exception: bool = False, config: Mapping[str, Any] | None = None,
                 allow_config_change: bool = False, clock: Callable[[], float] = time.monotonic):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"ModelCheckpoint(keep={keep!r}): keep must be a positive integer or None (keep all)")
        if best_mode not in ("max", "min"):
            raise ValueError(f"ModelCheckpoint(best_mode={best_mode!r}): use 'max' or 'min'")
        if not (resume is None or resume == "latest" or (isinstance(resume, int) and resume >= 0)):
            raise ValueError(f"ModelCheckpoint(resume={resume!r}): use 'latest', a step number >= 0, or None")
        Periodic(every_n_steps, every_secs, clock)  # validates both
        self._directory = directory
        self.every_n_steps, self.every_secs, self.clock = every_n_steps, every_secs, clock
        self.keep, self.best_metric, self.best_mode = keep, best_metric, best_mode
        self.async_save, self.resume, self.save_on_exception = async_save, resume, save_on_exception
        self.config, self.allow_config_change = config, allow_config_change
        self.io: CheckpointIO | None = None
        self.restored_step: int | None = None
        self.saved_step: int | None = None
        self._run_config: dict | None = None
        self._model: dict | None = None
        self._best: dict | None = None
        self._last_state: TrainState | None = None

    @property
    def directory(self) -> Path:
        if self.io is None:
            raise RuntimeError("ModelCheckpoint.directory is known once fit has started")
        return self.io.directory

    # -- what part of the params is saved ------------------------------------------------------------
    def params_to_save(self, params: Any) -> Any:
        """The part of the params a checkpoint holds: all of the trainable pytree (a LoRA module's
        trainable pytree is its adapters; the frozen base is reloaded from its own folder)."""
        return params

    def params_from_checkpoint(self, fresh_params: Any, saved: Any) -> Any:
        """Combines restored `saved` (what `params_to_save` returned) with freshly built params."""
        del fresh_params
        return saved

    # -- hooks -------------------------------------------------------------------------------------
    def open(self, run: RunInfo) -> None:
        """Opens the checkpoint directory (on_restore does it; call it to save without fitting)."""
        self.io = CheckpointIO(self._directory or Path(run.run_dir) / "checkpoints", async_save=self.async_save)
        self._periodic = Periodic(self.every_n_steps, self.every_secs, self.clock)
        self._best = self._read_best()

    def on_restore(self, run: RunInfo, state: TrainState) -> Restore | None:
        """Opens the directory and, when it holds checkpoints, returns the newest usable one to restore."""
        self.open(run)
        self._last_state, self.restored_step, self.saved_step = state, None, None
        self._run_config = config_guard.config_record(run, self.config)
        self._model = checkpoint_meta.model_record(run.card, state.params)
        steps = self.io.steps()
        first = self.io.first_saved()
        if not steps and first is not None and self.resume is not None:
            aside = sorted(p.name for p in self.io.directory.iterdir() if "." in p.name and p.name.split(".")[0].isdigit())
            raise NoUsableCheckpoint(
                f"{self.io.directory} had checkpoints (the first at step {first}) but none is left "
                f"(set aside: {', '.join(aside) or 'none'}); restore them, or start over in a fresh run directory "
                "(ModelCheckpoint(resume=None) starts this one from step 0)")
        if not steps:
            return None
        if self.resume is None:
            raise ValueError(f"{self.io.directory} already holds checkpoints (steps {steps}) and "
                             "ModelCheckpoint(resume=None); pass resume='latest' (or a step) or a fresh directory")
        restore = self._restore(run, state, steps)
        self._last_state = restore.state
        return restore

    def on_update_end(self, run: RunInfo, state: TrainState) -> None:
        self._last_state = state  # the state to save on an exception (the one before it was donated)

    def on_step_end(self, run: RunInfo, info: StepInfo) -> None:
        self._last_state = info.state
        self.io.note_finished()
        if self._periodic.should_fire(info.step):
            self.save(run, info.state)

    def on_validation_end(self, run: RunInfo, step: int, metrics: dict[str, float]) -> None:
        if self.best_metric is None or self.best_metric not in metrics:
            return
        value = float(metrics[self.best_metric])
        best = self._best
        if value != value or (best is not None and not (value > best["value"] if self.best_mode == "max" else value < best["value"])):
            return
        self._best = {"metric": self.best_metric, "mode": self.best_mode, "step": step, "value": value}
        if self._last_state is not None and self._last_state.step == step:
            self.save(run, self._last_state)  # a no-op when the periodic save already wrote it
        if run.is_main_process:
            write_json_atomic(self.io.directory / BEST_FILE, self._best)

    def on_fit_end(self, run: RunInfo, state: TrainState) -> None:
        self.save(run, state)  # the last step is always saved
        self.finish()

    def on_exception(self, run: RunInfo, exc: BaseException) -> None:
        if self.io is None:
            return
        if self.io.failed is not None:  # a write already failed (disk full): nothing more to try
            self.io.close()
            return
        last = self._last_state
        if self.save_on_exception and last is not None:
            if _donated(last):  # the exception came inside an update that took them
                log.warning("not saving on %s: the state of step %d was donated to the update that failed; the "
                            "newest checkpoint is step %s", type(exc).__name__, last.step, self.saved_step)
            elif jax.process_count() == 1:
                self.save(run, last)
            else:  # a save is a collective, and an exception may have stopped this process alone
                log.warning("not saving on %s: with %d processes the others may not reach this save",
                            type(exc).__name__, jax.process_count())
        self.finish()

    # -- actions -----------------------------------------------------------------------------------
    def save(self, run: RunInfo, state: TrainState) -> bool:
        """Saves `state` (asynchronously when `async_save`) unless that step is already on disk.

        Returns:
          True when a save was started.
        """
        if state.step in self.io.manager.all_steps():
            return False
        lag = run.lag_steps
        needed = range(max(0, state.step - lag), state.step)  # weights the resumed producer will ask for
        held = run.retained_weights()
        retained = {k: held[k] for k in needed if k in held}
        versions = [[k, int(version)] for k, (_, version) in sorted(retained.items())]
        frozen = run.module.frozen_identity() if run.module is not None else None
        meta = checkpoint_meta.build(run, state, versions, self._run_config, self._model, frozen)
        arrays = {"params": self.params_to_save(state.params), "opt_state": state.opt_state, "rng": state.rng}
        saved = {str(k): self.params_to_save(params) for k, (params, _) in retained.items()}
        self.io.save(state.step, arrays, meta, saved or None)
        self.saved_step = state.step
        self._periodic.fired(state.step)
        self._prune(in_flight=state.step)
        log.info("checkpoint of step %d started in %s", state.step, self.io.directory)
        return True

    def wait(self) -> None:
        """Blocks until the last save is on disk."""
        if self.io is not None:
            self.io.wait()

    def finish(self) -> None:
        """Waits for the last save, applies `keep`, and releases Orbax's threads."""
        try:
            self.io.wait()
            self._prune(in_flight=None)
        finally:
            self.io.close()

    def state_dict(self) -> dict:
        return {}  # the best-step record lives in best.json: it may change after a step's save

    # -- helpers -----------------------------------------------------------------------------------
    def _restore(self, run: RunInfo, state: TrainState, steps: list[int]) -> Restore:
        if self.resume == "latest":
            candidates = steps
        elif self.resume in steps:
            candidates = [self.resume]
        else:
            raise ValueError(f"ModelCheckpoint(resume={self.resume}): no such checkpoint in {self.io.directory}; "
                             f"available steps: {steps}")
        template = {"params": self.params_to_save(state.params), "opt_state": state.opt_state, "rng": state.rng}
        accepted: list = []

        def check_meta(step: int, meta: dict) -> None:  # before any array of the step is read
            checkpoint_meta.check(step, meta)  # a bad field: this step is skipped
            # A LoRA/full or other-base mismatch is named rather than failing to restore: refused.
            check_frozen_identity(meta["frozen"], run.module.frozen_identity() if run.module is not None else None,
                                  self.io.directory)
            accepted[:] = config_guard.check(meta["config"], self._run_config, step=step, directory=self.io.directory,
                                             allow=self.allow_config_change)  # a changed config: refused
            self._check_producer(run, meta)

        step, arrays, meta, retained = self.io.restore_usable(candidates, template, template["params"], check_meta)
        if accepted and run.is_main_process:
            path = config_guard.record_changes(run.run_dir, step, accepted)
            log.warning("resuming from step %d with a changed config (allowed): %s (recorded in %s)", step,
                        config_guard.describe(accepted), path)
        for later in [s for s in self.io.steps() if s > step]:  # the resumed run writes these steps anew
            moved = self.io.set_aside(later, "discarded")
            log.warning("resuming from step %d: later checkpoint %d moved to %s", step, later, moved)
        progress = meta["progress"]
        restored = state.replace(step=progress["step"], policy_version=progress["policy_version"],
                                 data_position=progress["data_position"], opt_state=arrays["opt_state"],
                                 rng=arrays["rng"], params=self.params_from_checkpoint(state.params, arrays["params"]))
        versions = dict(meta.get("retained_weights", []))
        weights = {k: (self.params_from_checkpoint(state.params, retained[k]), versions[k]) for k in retained}
        if self._best is not None and self._best["step"] > step:
            self._best = None  # it belonged to the discarded future
        self.restored_step = self.saved_step = step
        log.info("resumed from step %d of %s (data position %d)", step, self.io.directory, restored.data_position)
        return Restore(restored, callback_states=meta.get("callbacks", {}), weights=weights)

    def _check_producer(self, run: RunInfo, meta: dict) -> None:
        saved = meta.get("producer", {})
        for name, now in (("mode", run.mode), ("lag_steps", run.lag_steps)):
            if name in saved and saved[name] != now:
                raise ValueError(f"checkpoint in {self.io.directory} was written with Trainer {name}={saved[name]!r} but "
                                 f"this run has {name}={now!r}; an exact resume needs the same mode and max_staleness")

    def _prune(self, in_flight: int | None) -> None:
        """Deletes finalized checkpoints beyond the newest `keep` (never the in-flight or best one),
        so a crash during a save always leaves `keep` usable checkpoints."""
        if self.keep is None:
            return
        done = [s for s in sorted(self.io.manager.all_steps()) if s != in_flight]
        protect = set(done[-self.keep:]) | ({self._best["step"]} if self._best else set())
        for step in done:
            if step not in protect:
                self.io.delete(step)

    def _read_best(self) -> dict | None:
        best = read_json(self.io.directory / BEST_FILE) if self.best_metric else None
        if best and best.get("metric") == self.best_metric and best.get("mode") == self.best_mode:
            return best
        return None


def _donated(state: TrainState) -> bool:
    """Whether any array of `state` was deleted (donated to an update that has since run)."""
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves((state.params, state.opt_state)))
