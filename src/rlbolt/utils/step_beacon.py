"""A process's last completed step, for `rlbolt launch` to name when the process dies.

`rlbolt launch` gives every process it starts a file (`$RLBOLT_STEP_FILE`). The Trainer writes
"step N" there after each training step, a rollout group's process "rolled out step N" after
each step it rolled out, atomically (a kill never leaves half a line). When a process fails, the
launcher's one line names the process, how it ended and this last step. Without the variable
(a run not started by `rlbolt launch`) nothing is written. Imports no JAX: the launcher reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rlbolt.utils.files import write_text_atomic

ENV_STEP_FILE = "RLBOLT_STEP_FILE"


def record_step(what: str, environ: Mapping[str, str] = os.environ) -> None:
    """Writes `what` (e.g. "step 3") to `$RLBOLT_STEP_FILE` when the launcher set it.

    Args:
      what: the last completed step, in words.
      environ: the environment (default this process's).
    """
    path = environ.get(ENV_STEP_FILE)
    if path:
        try:
            write_text_atomic(path, what)
        except OSError:  # the launcher's note must never fail a step
            pass


def last_step(path: str | os.PathLike) -> str | None:
    """What a process last recorded, or None (nothing recorded, or unreadable).

    Args:
      path: the process's step file.
    """
    try:
        return Path(path).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
