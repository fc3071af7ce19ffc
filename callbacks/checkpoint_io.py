"""Orbax I/O behind ModelCheckpoint: one step = three named items, restored into abstract targets.

    <directory>/<step>/state             params, opt_state, rng   (arrays, Orbax StandardSave)
    <directory>/<step>/meta              progress counters, producer counters, callback states (JSON)
    <directory>/<step>/retained_weights  async mode only: {steps completed: params} the producer still needs
    <directory>/best.json                the best step by a metric (written by ModelCheckpoint)

Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when every item is on
disk, so a process killed mid-save leaves the previous steps untouched and no half-written step
under a step name. A step that is on disk but fails to restore (a truncated or deleted array
file) is reported and skipped in favour of the one before it; the bad step is then renamed
`<step>.corrupt` (Orbax ignores the name) so the resumed run can write that step again.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rlbolt.utils.files import write_text_atomic

STATE, META, RETAINED = "state", "meta", "retained_weights"


class CheckpointIO:
    """A CheckpointManager over `directory` that saves and restores rlbolt's three items.

    Args:
      directory: the checkpoint folder (created if missing).
      async_save: write arrays on a background thread (the device-to-host copy still happens
        before `save` returns, so later updates cannot change what is written).
    """

    def __init__(self, directory: str | os.PathLike, *, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Finalized steps on disk, oldest first (re-read: another process may have written)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any],
             retained: dict[str, Any] | None = None) -> None:
        """Starts saving `step` (returns once the arrays are copied to host when async).

        Args:
          step: the step number (the directory name).
          arrays: {"params", "opt_state", "rng"} pytrees of arrays.
          meta: JSON-serialisable dict.
          retained: {str(steps completed): params} or None.
        """
        _check_json(meta)
        items = {STATE: ocp.args.StandardSave(arrays), META: ocp.args.JsonSave(meta)}
        if retained:
            items[RETAINED] = ocp.args.StandardSave(retained)
        # force: ModelCheckpoint decides when to save, not Orbax's save-interval policy.
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def read_meta(self, step: int) -> dict:
        """The JSON meta item of one step (cheap: no array is read)."""
        return self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore(self, step: int, abstract_arrays: Any, abstract_params: Any) -> tuple[dict, dict, dict]:
        """Restores one step into the structure, dtypes and shardings of the abstract targets.

        Args:
          step: the step to read.
          abstract_arrays: {"params", "opt_state", "rng"} of arrays or ShapeDtypeStructs.
          abstract_params: the params structure, the target of every retained weight.

        Returns:
          (arrays, meta, retained) with retained = {steps completed: params}.
        """
        meta = self.read_meta(step)
        keys = [int(k) for k, _ in meta.get("retained_weights", [])]
        items = {STATE: ocp.args.StandardRestore(abstract(abstract_arrays))}
        if keys:
            target = abstract(abstract_params)
            items[RETAINED] = ocp.args.StandardRestore({str(k): target for k in keys})
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        retained = {k: out[RETAINED][str(k)] for k in keys} if keys else {}
        return dict(out[STATE]), meta, retained

    def restore_usable(self, steps: list[int], abstract_arrays: Any, abstract_params: Any):
        """Restores the newest of `steps` that reads back; warns about (and sets aside) newer bad ones.

        Returns:
          (step, arrays, meta, retained).

        Raises:
          RuntimeError: no step restores (nothing is renamed then: the cause may be a changed
            model rather than corruption).
        """
        failures: list[tuple[int, BaseException]] = []
        for step in sorted(steps, reverse=True):
            try:
                arrays, meta, retained = self.restore(step, abstract_arrays, abstract_params)
            except Exception as exc:  # noqa: BLE001 - any read error makes the step unusable
                failures.append((step, exc))
                continue
            for bad, exc in failures:
                moved = self.set_aside(bad, "corrupt")
                warnings.warn(f"checkpoint step {bad} in {self.directory} is unusable "
                              f"({type(exc).__name__}: {exc}); resuming from step {step} instead "
                              f"(the bad step was moved to {moved.name})", RuntimeWarning, stacklevel=2)
            return step, arrays, meta, retained
        details = "; ".join(f"step {s}: {type(e).__name__}: {e}" for s, e in failures)
        raise RuntimeError(f"no checkpoint in {self.directory} restores ({details}). If the model or optimizer "
                           "changed since they were written, use a fresh directory or resume=None") from failures[0][1]

    def set_aside(self, step: int, reason: str) -> Path:
        """Renames step `step` to `<step>.<reason>[.n]` (a name Orbax does not read as a step)."""
        self.wait()
        source = self.directory / str(step)
        target = self.directory / f"{step}.{reason}"
        n = 1
        while target.exists():
            target, n = self.directory / f"{step}.{reason}.{n}", n + 1
        if jax.process_index() == 0:
            source.rename(target)
        self.manager.reload()
        return target

    def delete(self, step: int) -> None:
        self.manager.delete(step)

    def wait(self) -> None:
        """Blocks until an in-flight asynchronous save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract(tree: Any) -> Any:
    """Arrays -> ShapeDtypeStructs keeping their shardings (already abstract leaves pass through)."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(leaf, tree)


def read_json(path: Path) -> dict | None:
    """A small JSON side file, or None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, value: dict) -> None:
    """Writes JSON via a temporary file and a rename, so a kill never leaves a half-written file."""
    write_text_atomic(path, json.dumps(value))


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
