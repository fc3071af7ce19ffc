"""Leaving a multi-process run after a silent process, without JAX's shutdown barrier.

`jax.distributed.shutdown` (registered by JAX with `atexit`) waits at a barrier for every process,
the silent one too, up to its 300 s shutdown timeout. A process that has given up on a silent peer
(`GroupLink`, the rows' Flight dock) calls `skip_shutdown_barrier()`: at exit it then leaves with
status 1 before JAX's handler runs (registered after it, so first: atexit is last in, first out).
"""

from __future__ import annotations

import atexit
import os
import sys

_exit_armed = False


def _exit_without_shutdown_barrier() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def skip_shutdown_barrier() -> None:
    """At exit, leave with status 1 before `jax.distributed.shutdown`'s barrier (idempotent)."""
    global _exit_armed
    if not _exit_armed:
        _exit_armed = True
        atexit.register(_exit_without_shutdown_barrier)
