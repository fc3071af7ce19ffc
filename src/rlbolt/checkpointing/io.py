"""Orbax I/O behind ModelCheckpoint: one step = three named items, restored into abstract targets.

    <directory>/<step>/state             params, opt_state, rng   (arrays, Orbax StandardSave)
    <directory>/<step>/meta              progress counters, producer counters, callback states,
                                         the run's config, the model's description, and the
                                         integrity record of every array (JSON)
    <directory>/<step>/retained_weights  async mode only: {steps completed: params} the producer still needs
    <directory>/best.json                the best step by a metric (written by ModelCheckpoint)
    <directory>/saved.json               written once the first checkpoint is on disk: a run that
                                         had checkpoints never silently restarts from step 0

Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when every item is on
disk, so a process killed mid-save leaves the previous steps untouched and no half-written step
under a step name. Reading a step checks, before it is used: the metadata (readable, every
field of the right type, via `check_meta`), that the stored arrays are the ones this run builds
(names, shapes, dtypes), the checksum of every array (`checkpoint_integrity`), and that the
parameters are finite. A step that fails is reported with its reason and skipped in favour of
the one before it; the bad step is then renamed `<step>.corrupt` (Orbax ignores the name) so
the resumed run can write that step again. With training and rollout on process groups of their
own, the training group's processes alone save and restore, over barriers that name only them
(`checkpointing/processes.py`). A reader (`read_only=True`: export, evaluation
scripts) never deletes, renames or cleans anything: a training process may be writing.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlbolt.checkpointing import integrity
from rlbolt.checkpointing.integrity import CheckpointCorrupt
from rlbolt.checkpointing.processes import barrier, multiprocessing_options
from rlbolt.checkpointing.targets import abstract, local_target, placed_like
from rlbolt.distributed.agree import default_group
from rlbolt.models.stacked_layers import saved_layout, to_layout
from rlbolt.utils.files import format_size, is_disk_full, write_text_atomic

STATE, META, RETAINED = "state", "meta", "retained_weights"
SAVED_FILE = "saved.json"
PARAMS_PREFIX = "params/"


class NoUsableCheckpoint(RuntimeError):
    """No checkpoint step can be restored (each one's reason is in the one-line message)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions, ...): one line saying what,
    where, and (for a full disk) the free space against what the checkpoint needs."""


class CheckpointIO:
    """A CheckpointManager over `directory` that saves and restores rlbolt's three items.

    Args:
      directory: the checkpoint folder (created if missing, unless `read_only`).
      async_save: write arrays on a background thread (the device-to-host copy still happens
        before `save` returns, so later updates cannot change what is written).
      read_only: open for reading only: nothing in the folder is created, cleaned, renamed or
        deleted (what `rlbolt export` uses while a run may be training).
      processes: the processes that save and restore together (`checkpointing.processes`; default:
        the fit's process group, `agree.default_group`, else every process); the first is the
        primary host, which writes the side files and renames.
    """

    def __init__(self, directory: str | os.PathLike, *, async_save: bool = True, read_only: bool = False,
                 processes: tuple[int, ...] | None = None):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self.processes = default_group() if processes is None else tuple(sorted(set(processes)))
        if self.processes is not None and jax.process_index() not in self.processes:
            raise RuntimeError(f"process {jax.process_index()} opened a checkpoint of processes {list(self.processes)} "
                               "without being one of them; only the training group saves")
        self.primary = 0 if self.processes is None else self.processes[0]
        group = multiprocessing_options(self.processes, jax.process_count())
        self.failed: CheckpointWriteError | None = None
        self._pending: tuple[int, int] | None = None  # (step, bytes) of the save in flight
        self._ledger_written = read_only
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                                   save_interval_steps=0, multiprocessing_options=group)
        else:
            # Orbax creates the folder only when every process saves; for a group, each member makes it
            if group.active_processes is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
            options = ocp.CheckpointManagerOptions(create=group.active_processes is None,
                                                   enable_async_checkpointing=async_save,
                                                   cleanup_tmp_directories=True, multiprocessing_options=group)
        self.async_save = async_save and not read_only
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Finalized steps on disk, oldest first (re-read: another process may have written)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def first_saved(self) -> int | None:
        """The first step this directory ever finalized (from `saved.json`), or None."""
        try:
            value = json.loads((self.directory / SAVED_FILE).read_text()).get("first_saved_step")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) else None

    # -- writing ---------------------------------------------------------------------------------
    def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any],
             retained: dict[str, Any] | None = None) -> None:
        """Starts saving `step` (returns once the arrays are copied to host when async).

        Args:
          step: the step number (the directory name).
          arrays: {"params", "opt_state", "rng"} pytrees of arrays.
          meta: JSON-serialisable dict; the integrity record of the arrays is added to it.
          retained: {str(steps completed): params} or None.

        Raises:
          CheckpointWriteError: this save, or the previous asynchronous one, could not be written.
        """
        if self.read_only:
            raise RuntimeError(f"CheckpointIO({self.directory}, read_only=True) cannot save")
        meta = {**meta, "integrity": {STATE: integrity.record(arrays), RETAINED: integrity.record(retained or {})}}
        _check_json(meta)
        items = {STATE: ocp.args.StandardSave(arrays), META: ocp.args.JsonSave(meta)}
        if retained:
            items[RETAINED] = ocp.args.StandardSave(retained)
        self.wait()  # a failure of the previous save is reported as that step's
        self._pending = (step, _nbytes(arrays) + _nbytes(retained or {}))  # until a wait() sees it on disk
        try:
            # force: ModelCheckpoint decides when to save, not Orbax's save-interval policy.
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as exc:  # noqa: BLE001 - reported as one line; Orbax's traceback is in the log
            raise self._write_error(exc) from exc
        self.note_finished()

    def note_finished(self) -> None:
        """Records, once, that this directory has had a finished checkpoint (`saved.json`), as
        soon as the save in flight is on disk. Cheap: ModelCheckpoint calls it after every step."""
        pending = self._pending
        if self._ledger_written or pending is None or not (self.directory / str(pending[0])).is_dir():
            return
        if jax.process_index() == self.primary and self.first_saved() is None:
            write_text_atomic(self.directory / SAVED_FILE, json.dumps({"first_saved_step": pending[0]}))
        self._ledger_written = True

    def wait(self) -> None:
        """Blocks until an in-flight asynchronous save is on disk.

        Raises:
          CheckpointWriteError: it could not be written (reported once).
        """
        if self.failed is not None or self.read_only:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            raise self._write_error(exc) from exc
        self.note_finished()
        self._pending = None

    def _write_error(self, exc: BaseException) -> CheckpointWriteError:
        step, need = self._pending or (None, 0)
        self._pending = None
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = None
        if is_disk_full(exc):
            space = f"free {format_size(free)}, this checkpoint needs about {format_size(need)}" if free is not None else ""
            reason = f"no space left on device ({space})"
        else:
            reason = f"{type(exc).__name__}: {_first_line(exc, directory=self.directory)}"
        kept = sorted(self.manager.all_steps()) if self.manager is not None else []
        self.failed = CheckpointWriteError(
            f"could not write {what} to {self.directory}: {reason}; nothing half-written is used as a checkpoint "
            f"(finished checkpoints: {kept or 'none'}); free space or fix the folder, then resume")
        return self.failed

    def delete(self, step: int) -> None:
        if not self.read_only:
            self.manager.delete(step)

    def close(self) -> None:
        """Waits for the last save and releases Orbax's threads (quietly after a write failure)."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - only after a failed save, already reported once
                if self.failed is None:
                    raise

    def set_aside(self, step: int, reason: str) -> Path:
        """Renames step `step` to `<step>.<reason>[.n]` (a name Orbax does not read as a step)."""
        if self.read_only:
            raise RuntimeError(f"CheckpointIO({self.directory}, read_only=True) does not rename steps")
        self.wait()
        source = self.directory / str(step)
        target = self.directory / f"{step}.{reason}"
        n = 1
        while target.exists():
            target, n = self.directory / f"{step}.{reason}.{n}", n + 1
        if jax.process_index() == self.primary:
            source.rename(target)
        barrier(f"rlbolt set_aside {step} {reason}", self.processes)  # nobody re-reads the folder before the rename
        self.manager.reload()
        return target

    # -- reading ---------------------------------------------------------------------------------
    def read_meta(self, step: int) -> dict:
        """The step's metadata, with its integrity record checked for form.

        Raises:
          CheckpointCorrupt: unreadable, not a mapping, or a malformed integrity record.
        """
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        except Exception as exc:  # noqa: BLE001 - any read error makes the step unusable
            raise CheckpointCorrupt(f"its metadata cannot be read ({type(exc).__name__}: "
                                   f"{_first_line(exc, directory=self.directory)})") from exc
        if not isinstance(meta, dict):
            raise CheckpointCorrupt(f"its metadata is {type(meta).__name__}, not a mapping")
        record = meta.get("integrity")
        if not isinstance(record, dict):
            raise CheckpointCorrupt("its metadata has no integrity record (meta.integrity)")
        for item in (STATE, RETAINED):
            integrity.check_record(record.get(item), f"meta.integrity.{item}")
        return meta

    def restore(self, step: int, abstract_arrays: Any, abstract_params: Any,
                check_meta: Callable[[int, dict], None] | None = None) -> tuple[dict, dict, dict]:
        """Restores one step into the structure, dtypes and shardings of the abstract targets.

        Args:
          step: the step to read.
          abstract_arrays: {"params", "opt_state", "rng"} of arrays or ShapeDtypeStructs.
          abstract_params: the params structure, the target of every retained weight.
          check_meta: called with (step, meta) before any array is read; raises
            CheckpointCorrupt for a damaged field (the step is skipped), anything else to refuse.

        Returns:
          (arrays, meta, retained) with retained = {steps completed: params}.

        Raises:
          CheckpointCorrupt: the step is damaged or does not match the targets (the message says which).
        """
        meta = self.read_meta(step)
        if check_meta is not None:
            check_meta(step, meta)
        record = meta["integrity"]
        keys = [int(k) for k, _ in meta.get("retained_weights", [])]
        # The decoder's layers stored stacked or per layer (rlbolt.models.stacked_layers): the step is
        # read in the layout it was saved in, then converted to this run's.
        saved, wanted = saved_layout(record[STATE]), saved_layout(integrity.named_leaves(abstract_arrays))
        convert = saved is not None and wanted is not None and saved != wanted
        arrays_target = to_layout(abstract(abstract_arrays), saved if convert else None)  # no array is copied
        integrity.check_layout(record[STATE], arrays_target)
        items = {STATE: ocp.args.StandardRestore(arrays_target)}
        if keys:
            params_target = to_layout(abstract(abstract_params), saved if convert else None)
            target = {str(k): params_target for k in keys}
            integrity.check_layout(record[RETAINED], target)
            items[RETAINED] = ocp.args.StandardRestore(target)
        out = self._restore_items(step, items)
        integrity.verify(out[STATE], record[STATE], finite=(PARAMS_PREFIX,))
        if keys:
            integrity.verify(out[RETAINED], record[RETAINED], finite=("",))
        retained = {k: out[RETAINED][str(k)] for k in keys} if keys else {}
        if convert:
            arrays = placed_like(to_layout(dict(out[STATE]), wanted), abstract(abstract_arrays))
            retained = {k: placed_like(to_layout(p, wanted), abstract(abstract_params)) for k, p in retained.items()}
            return arrays, meta, retained
        return dict(out[STATE]), meta, retained

    def restore_params(self, step: int) -> tuple[Any, dict]:
        """Restores a step's parameters as saved (nested dicts), without a module to restore into
        (what export uses); checksums and finiteness are verified. Every array is read whole onto
        this process's first device (`local_target`), whatever mesh and processes wrote it.

        Returns:
          (params, meta).
        """
        meta = self.read_meta(step)
        try:
            target = local_target(self.directory / str(step) / STATE)
        except Exception as exc:  # noqa: BLE001 - any read error makes the step unusable
            raise CheckpointCorrupt(f"its array metadata cannot be read ({type(exc).__name__}: "
                                   f"{_first_line(exc, directory=self.directory)})") from exc
        out = self._restore_items(step, {STATE: ocp.args.StandardRestore(target)})
        integrity.verify(out[STATE], meta["integrity"][STATE], finite=(PARAMS_PREFIX,))
        return out[STATE]["params"], meta

    def _restore_items(self, step: int, items: dict) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as exc:  # noqa: BLE001 - any read error makes the step unusable
            raise CheckpointCorrupt(f"its arrays cannot be read ({type(exc).__name__}: "
                                   f"{_first_line(exc, directory=self.directory)})") from exc

    def restore_usable(self, steps: list[int], abstract_arrays: Any = None, abstract_params: Any = None,
                       check_meta: Callable[[int, dict], None] | None = None) -> tuple[int, Any, dict, dict]:
        """Restores the newest of `steps` that passes every check; warns about (and, unless
        read-only, sets aside) newer bad ones. With `abstract_arrays=None` only the parameters
        are restored (`restore_params`) and the result is (step, params, meta, {}).

        Returns:
          (step, arrays, meta, retained).

        Raises:
          NoUsableCheckpoint: no step passes; the one-line message lists each step's reason
            (nothing is renamed then: the cause may be a changed model rather than corruption).
        """
        failures: list[tuple[int, CheckpointCorrupt]] = []
        for step in sorted(steps, reverse=True):
            try:
                if abstract_arrays is None:
                    params, meta = self.restore_params(step)
                    arrays, retained = params, {}
                else:
                    arrays, meta, retained = self.restore(step, abstract_arrays, abstract_params, check_meta)
            except CheckpointCorrupt as exc:
                failures.append((step, exc))
                continue
            for bad, exc in failures:
                if self.read_only and not (self.directory / str(bad)).exists():
                    continue  # pruned by the training process while it was read: not damage
                if self.read_only:
                    where = "left in place: this process only reads"
                else:
                    where = f"moved to {self.set_aside(bad, 'corrupt').name}"
                warnings.warn(f"checkpoint step {bad} in {self.directory} is unusable: {exc}; using step {step} "
                              f"instead ({where})", RuntimeWarning, stacklevel=2)
            return step, arrays, meta, retained
        details = "; ".join(f"step {s}: {e}" for s, e in failures)
        raise NoUsableCheckpoint(f"no usable checkpoint in {self.directory} ({details}); restore them from a copy, "
                                 "or start over in a fresh run directory")


def read_json(path: Path) -> dict | None:
    """A small JSON side file, or None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, value: dict) -> None:
    """Writes JSON via a temporary file and a rename, so a kill never leaves a half-written file."""
    write_text_atomic(path, json.dumps(value))


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _first_line(exc: BaseException, limit: int = 160, directory: Path | None = None) -> str:
    text = " ".join(str(exc).strip().splitlines()[:1]) or type(exc).__name__
    if directory is not None:  # the message already names the folder
        text = text.replace(f"{directory}/", "").replace(str(directory), ".")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_json(meta: dict[str, Any]) -> None:
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        for name, state in meta.get("callbacks", {}).items():
            try:
                json.dumps(state)
            except (TypeError, ValueError):
                raise TypeError(f"callback {name!r}: state_dict() must return JSON-serialisable values "
                                f"(plain int/float/str/list/dict): {exc}") from exc
        raise
