"""How the sandbox child is started, and which isolation layers this host allows.

Three ways to start the child, strongest first; `isolation="auto"` takes the first that works
here (probed once per interpreter) and every `SandboxResult` lists the layers that were active:

- ``"bwrap"``: bubblewrap (the `bwrap` binary, from the OS package `bubblewrap`; the sandbox
  behind Flatpak). New user, pid, network, IPC, UTS and cgroup namespaces; a new root that
  holds only the system folders and the interpreter (`filesystem_view`), read-only; private
  size-capped tmpfs on /tmp and /dev/shm; a minimal /dev; a private /proc; no capabilities;
  killed with its parent. Used when present.
- ``"namespaces"``: the same layers built by the launcher itself with unshare(2) through
  ctypes (see `_sandbox_launcher.py`): needs nothing but Python, where the kernel allows
  unprivileged user namespaces (most distributions; not inside a default Docker container).
- ``"none"``: no namespaces. What is left: the resource limits, a new session, the fresh uid
  (root only), the audit hook, and afterwards killing everything of that uid and deleting its
  files in the world-writable folders. Enough against honest mistakes, not against a hostile
  program: run the trainer in a container (or install bubblewrap) where this is all you get.

Orthogonal to the backend: when the trainer runs as root, the child runs as a fresh uid from
200000-299998 (per run), so the kernel's permission checks apply, RLIMIT_NPROC counts only the
sandbox's processes, and every process of that uid can be found and killed afterwards.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ISOLATION_BACKENDS", "sandbox_layers"]

ISOLATION_BACKENDS = ("auto", "bwrap", "namespaces", "none")
LAUNCHER_SOURCE = Path(__file__).with_name("_sandbox_launcher.py").read_text()
UID_RANGE = (200_000, 299_999)  # per-run uids (randrange: 299_999, the probe uid, excluded)
WORKDIR_IN_NAMESPACE = "/tmp/work"
_PROBE_UID = 299_999
_SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")
_BWRAP_LAYERS = ("bubblewrap", "user-namespace", "pid-namespace", "network-namespace", "ipc-uts-namespaces",
                 "minimal-filesystem-view", "read-only-filesystem", "private-tmpfs", "private-proc",
                 "no-capabilities")


def drop_kwargs(uid: int | None) -> dict:
    """Popen arguments that start the child as `uid` (and a group of the same number)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def filesystem_view(python: str) -> list[str]:
    """The folders a namespaced child sees (read-only): the system's and the interpreter's.

    Home folders, datasets, checkpoints and the trainer's own files are not among them, so a
    program cannot read the tests of its own task from the training data on disk.
    """
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    candidates = ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc", prefix]
    return [path for path in dict.fromkeys(candidates) if os.path.lexists(path) and path != "/"]


def launcher_command(backend: str, python: str, config: dict, tmpfs_bytes: int) -> list[str]:
    """The argv that starts the launcher under `backend` (`config` gains the view)."""
    config = {**config, "view": filesystem_view(python)}
    launcher = [python, "-I", "-S", "-c", LAUNCHER_SOURCE, json.dumps(config)]
    if backend != "bwrap":
        return launcher
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent"]
    for path in config["view"]:
        bwrap += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
    bwrap += ["--dev", "/dev", "--proc", "/proc", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp",
              "--size", str(tmpfs_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/"]
    return [*bwrap, "--dir", WORKDIR_IN_NAMESPACE, "--chdir", WORKDIR_IN_NAMESPACE, "--", *launcher]


def _probe(backend: str, python: str, uid: int | None) -> tuple[str, ...] | None:
    """Starts the launcher in probe mode; its namespace layers, or None when it cannot run."""
    if backend == "bwrap" and not shutil.which("bwrap"):
        return None
    read_end, write_end = os.pipe()
    config = {"probe": True, "namespaces": backend == "namespaces", "task_fd": -1, "results_fd": write_end,
              "workdir": WORKDIR_IN_NAMESPACE, "tmpfs_bytes": 1 << 20}
    try:
        process = subprocess.Popen(
            launcher_command(backend, python, config, 1 << 20), pass_fds=(write_end,),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, **drop_kwargs(uid))
    except OSError:
        os.close(read_end)
        return None
    finally:
        os.close(write_end)
    try:
        returncode = process.wait(timeout=30)
        with os.fdopen(read_end, "rb") as handle:
            reply = handle.read(1 << 16)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        os.close(read_end)
        return None
    if returncode != 0:
        return None
    try:
        layers = json.loads(reply.decode().splitlines()[0])["layers"]
    except (ValueError, KeyError, IndexError):
        return None
    return _BWRAP_LAYERS if backend == "bwrap" else tuple(layers)


@functools.lru_cache(maxsize=None)
def python_for(drop: bool) -> str:
    """An interpreter the sandbox uid can execute (the venv's may sit under a private /root)."""
    candidates = [sys.executable, os.path.realpath(sys.executable),
                  getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in dict.fromkeys(candidates):
        if os.path.exists(candidate) and (not drop or _probe("none", candidate, _PROBE_UID) is not None):
            return candidate
    return sys.executable


@functools.lru_cache(maxsize=None)
def choose(isolation: str, python: str, drop: bool) -> tuple[str, tuple[str, ...]]:
    """(backend, its layers) for `isolation`; "auto" takes the strongest that works here.

    Raises:
        ValueError: an unknown name.
        RuntimeError: a named backend that cannot run on this host.
    """
    if isolation not in ISOLATION_BACKENDS:
        raise ValueError(f"run_python_sandboxed: isolation={isolation!r}; choose from {list(ISOLATION_BACKENDS)}")
    uid = _PROBE_UID if drop else None
    for backend in ("bwrap", "namespaces", "none") if isolation == "auto" else (isolation,):
        layers = _probe(backend, python, uid)
        if layers is not None:
            return backend, layers
    raise RuntimeError(
        f"run_python_sandboxed: isolation={isolation!r} cannot start {python!r} on this host "
        "(bwrap needs the bubblewrap package; namespaces need unprivileged user namespaces); "
        "use isolation='auto'"
    )


def sandbox_layers(isolation: str = "auto", *, drop_privileges: bool | None = None) -> tuple[str, ...]:
    """The isolation layers `run_python_sandboxed` gets on this host, strongest backend first.

    Args:
        isolation: "auto", "bwrap", "namespaces" or "none".
        drop_privileges: as in `run_python_sandboxed` (default: when running as root).

    Returns:
        Layer names, e.g. ``("bubblewrap", "user-namespace", ..., "fresh-uid", "rlimits",
        "audit-hook")``.
    """
    drop = os.geteuid() == 0 if drop_privileges is None else bool(drop_privileges)
    backend, layers = choose(isolation, python_for(drop), drop)
    return tuple(layers) + host_layers(backend, drop, audit_hook=True)


def host_layers(backend: str, drop: bool, *, audit_hook: bool) -> tuple[str, ...]:
    """The layers every backend adds (limits, session, uid, hook, cleanup)."""
    layers = ["rlimits", "new-session", "no-new-privileges"]
    if drop:
        layers.append("fresh-uid")
    if audit_hook:
        layers.append("audit-hook")
    if backend == "none" and drop:
        layers.append("uid-file-cleanup")
    return tuple(layers)


def live_processes(*, pgid: int | None = None, uid: int | None = None) -> list[int]:
    """Pids (zombies excluded: they are dead) in process group `pgid` or of real uid `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, _, group = stat.rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
        real_uid = re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)
        if state == "Z":
            continue
        if (pgid is not None and int(group) == pgid) or (
            uid is not None and real_uid is not None and int(real_uid.group(1)) == uid
        ):
            found.append(int(entry))
    return found


def kill_leftovers(pgid: int, uid: int | None, deadline_s: float = 5.0) -> None:
    """SIGKILLs the run's process group and, for a per-run uid, all of that uid's processes,
    until none is alive: killed orphans are reaped by init, a moment later."""
    stop = time.monotonic() + deadline_s
    while True:
        pids = set(live_processes(pgid=pgid)) | (set(live_processes(uid=uid)) if uid is not None else set())
        if not pids or time.monotonic() > stop:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def remove_files_of(uid: int, folders: tuple[str, ...] = _SHARED_DIRS) -> None:
    """Deletes what `uid` left in the world-writable folders (the "none" backend as root)."""
    for folder in folders:
        for root, dirs, files in os.walk(folder, topdown=False):
            for name in files + dirs:
                path = os.path.join(root, name)
                try:
                    if os.lstat(path).st_uid == uid:
                        (os.rmdir if name in dirs and not os.path.islink(path) else os.unlink)(path)
                except OSError:
                    pass
