"""One writer per run directory: an OS file lock on `<run_dir>/.rlbolt.lock`.

The lock is a POSIX record lock (`fcntl.lockf`): the kernel releases it when the holding
process dies, however it dies (SIGKILL included), so there is never a stale lock to clean up,
and it is not inherited by child processes (reward workers, sandboxes). The file itself stays
in the run directory; deleting it would race with a process that has just opened it. After
locking, the holder writes its PID, host and command into the file, so a refused process can
name it.

Within one process the lock is re-entrant: the `rlbolt` command takes it when it opens the run
directory and holds it until the process ends; `Trainer.fit` takes it again for the length of
the fit, which then only counts. POSIX locks belong to the process, so a second file descriptor
on the same file would silently share (and, when closed, drop) the lock: the registry below
keeps exactly one descriptor per locked file.

Readers (`rlbolt export`, `rlbolt plot`, evaluation scripts) never take the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".rlbolt.lock"

_held: dict[Path, list[int]] = {}  # lock file -> [fd, count]
_guard = threading.Lock()


class RunDirBusy(RuntimeError):
    """Another process holds the run directory's lock (the message names its PID)."""


def acquire(run_dir: str | os.PathLike) -> Path:
    """Locks `run_dir` for this process (creating the folder if needed); re-entrant.

    Args:
      run_dir: the run directory.

    Returns:
      The lock file.

    Raises:
      RunDirBusy: another process holds the lock; the message names it and says what to do.
    """
    run_dir = Path(run_dir)
    path = (run_dir / LOCK_FILE).absolute()
    with _guard:
        if path in _held:
            _held[path][1] += 1
            return path
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(f"run directory {run_dir} is in use by another rlbolt process ({holder}); wait for it "
                             "to end or stop it, or choose another run directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, _describe_self().encode(), 0)
        _held[path] = [fd, 1]
        return path


def release(run_dir: str | os.PathLike) -> None:
    """Undoes one `acquire`; the last one unlocks (the file stays)."""
    path = (Path(run_dir) / LOCK_FILE).absolute()
    with _guard:
        entry = _held.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            os.close(entry[0])  # closing the only descriptor releases the POSIX lock


def is_held(run_dir: str | os.PathLike) -> bool:
    """True when this process holds the lock of `run_dir`."""
    return (Path(run_dir) / LOCK_FILE).absolute() in _held


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike) -> Iterator[Path]:
    """`acquire` for the length of a `with` block."""
    path = acquire(run_dir)
    try:
        yield path
    finally:
        release(run_dir)


def _describe_self() -> str:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
    return (f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}, "
            f"command: {command[:200]}")


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 1000, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return " ".join(text.split()) or "PID unknown"


@contextlib.contextmanager
def hold_run_dir(run_dir: str | os.PathLike, writes: bool) -> Iterator[bool]:
    """Holds `run_dir` for a fit when `writes` (one of its callbacks writes there, `writes_run_dir = True`,
    and this is process 0); yields whether it locked."""
    if not writes:
        yield False
        return
    with hold(run_dir):
        yield True
