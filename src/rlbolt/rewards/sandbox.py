"""Run untrusted Python (a model's code answer) in a throw-away, resource-limited child process.

Defences, in layers; each covers what the one before cannot:

1. **Resource limits** (set by the child on itself before the code runs): RLIMIT_CPU (busy
   loops), RLIMIT_AS (memory bombs), RLIMIT_FSIZE (disk fills, and runaway output: stdout and
   stderr go to files), RLIMIT_NPROC (fork bombs), RLIMIT_NOFILE (descriptor exhaustion),
   RLIMIT_CORE=0 (no core dumps). A wall-clock limit catches code that sleeps or blocks.
2. **A new session**: on time-out, and always at the end, the whole process group is killed, so
   forked children cannot outlive the run.
3. **A throw-away working directory** under the system temp dir, deleted in every case.
4. **An unprivileged uid** (when we run as root, as in containers and some CI): a fresh uid per
   run, so the kernel enforces file permissions (no writes to root-owned files), RLIMIT_NPROC
   applies (root ignores it), and every process of that uid can be found and killed afterwards
   even if it escaped the process group.
5. **A network namespace** (`unshare --net`, util-linux) when available and permitted: the child
   sees only a downed loopback, so no connection leaves it at the kernel level.
6. **A Python audit hook** (`sys.addaudithook`) installed before the code runs: denies sockets,
   fork/exec/spawn/system/subprocess, signals to other processes, ctypes (which could bypass
   the hook), raising rlimits, and opening for writing (or renaming, removing, chmod-ing)
   anything outside the working directory. This is the layer that still holds when 4 and 5 are
   unavailable (not root, no unshare), but audit hooks are a tripwire, not a security boundary:
   determined code can evade them, which is why the kernel-level layers come first.

Without root and user namespaces only layers 1-3 and 6 apply; treat that as "keeps honest
mistakes and naive reward hacks contained", not as isolation from a hostile program.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SandboxResult", "code_reward", "extract_code", "run_python_sandboxed"]

MiB = 1 << 20
_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
_TASK_FILE = "task.json"
_UID_RANGE = (200_000, 300_000)  # per-run uids: unassigned on normal systems
_NO_REPORT = "the program ended before the test harness reported (os._exit?)"

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        ok: exited 0 within the limits and, when tests were given, passed all of them.
        returncode: the child's exit status (negative: killed by that signal), None if unknown.
        stdout: captured standard output (harness line removed; truncated to the output limit).
        stderr: captured standard error (truncated).
        timed_out: the wall-clock limit was reached and the process group was killed.
        reason: one line saying why the run is not ok, or "ok".
        tests_passed: how many tests passed (0 when the harness never reported).
        tests_total: how many tests were given.
        pid: the child's pid, also its process-group id (all of it is gone when this returns).
    """

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    reason: str
    tests_passed: int = 0
    tests_total: int = 0
    pid: int = -1


@functools.lru_cache(maxsize=None)
def _launch_plan(drop: bool, netns: bool, python: str) -> tuple[tuple[str, ...], str | None] | None:
    """(command prefix, how the uid is dropped: "unshare", "popen" or None), probed once.

    Tries the strongest combination first and falls back, so a machine without unshare or
    without root still runs code, with the remaining layers.
    """
    unshare = shutil.which("unshare")
    as_nobody = ("--setgid", "65534", "--setuid", "65534")
    attempts: list[tuple[tuple[str, ...], str | None]] = []
    if netns and unshare and os.geteuid() == 0:
        attempts.append(((unshare, "--net", *(as_nobody if drop else ())), "unshare" if drop else None))
    elif netns and unshare:
        attempts.append(((unshare, "--user", "--map-current-user", "--net"), None))
    if drop and unshare:
        attempts.append(((unshare, *as_nobody), "unshare"))
    if drop:
        attempts.append(((), "popen"))
    attempts.append(((), None))
    for prefix, drop_mode in attempts:
        extra = {"user": 65534, "group": 65534, "extra_groups": []} if drop_mode == "popen" else {}
        try:
            returncode = subprocess.run(
                [*prefix, python, "-I", "-S", "-c", "import resource, json"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                timeout=30, check=False, **extra,
            ).returncode
        except (OSError, subprocess.SubprocessError):  # e.g. the uid may not execute `python`
            returncode = -1
        if returncode == 0:
            return prefix, drop_mode
    return None


@functools.lru_cache(maxsize=None)
def _default_python(drop: bool) -> str:
    """An interpreter the sandbox uid can execute (the venv's may sit under a private /root)."""
    candidates = [sys.executable, os.path.realpath(sys.executable),
                  getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3",
                  "/usr/local/bin/python3"]
    for candidate in dict.fromkeys(candidates):
        if not os.path.exists(candidate):
            continue
        plan = _launch_plan(drop, False, candidate) if drop else ((), None)
        if plan is not None and (not drop or plan[1] is not None):
            return candidate
    return sys.executable


def _live_processes(*, pgid: int | None = None, uid: int | None = None) -> list[int]:
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


def _kill_leftovers(pgid: int, uid: int | None, deadline_s: float = 5.0) -> None:
    """SIGKILLs the run's process group and, for a per-run uid, all of that uid's processes,
    until none is alive: killed orphans are reaped by init, a moment later."""
    stop = time.monotonic() + deadline_s
    while True:
        pids = set(_live_processes(pgid=pgid)) | (set(_live_processes(uid=uid)) if uid is not None else set())
        if not pids or time.monotonic() > stop:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as handle:
        return handle.read(limit).decode("utf-8", errors="replace")


def _reason(returncode: int | None, timed_out: bool, wall_s: float, stderr: str) -> str:
    if timed_out:
        return f"timed out after {wall_s} s (wall-clock limit)"
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {"SIGXCPU": "cpu_s limit", "SIGKILL": "cpu_s or memory limit", "SIGXFSZ": "file_size_bytes limit"}
        return f"killed by {name}" + (f" ({hint[name]})" if name in hint else "")
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"exit code {returncode}: {last}".rstrip(": ")


def run_python_sandboxed(
    code: str,
    *,
    stdin: str | None = None,
    tests: str | Sequence[str] | None = None,
    cpu_s: int = 2,
    memory_bytes: int = 512 * MiB,
    wall_s: float = 5.0,
    file_size_bytes: int = 1 * MiB,
    max_procs: int = 16,
    max_open_files: int = 64,
    max_output_bytes: int = 64 * 1024,
    drop_privileges: bool | None = None,
    network_namespace: bool = True,
    audit_hook: bool = True,
    python: str | None = None,
) -> SandboxResult:
    """Runs `code` (then `tests`) in a sandboxed `python -I -S` child (see the module docstring).

    Args:
        code: the program's source.
        stdin: text fed to the program's standard input (empty when None).
        tests: Python source run after the program in its namespace; one string counts as one
            test, a sequence of strings (e.g. `assert f(2) == 4` each) counts each separately.
        cpu_s: CPU-time limit in seconds (SIGXCPU, then SIGKILL one second later).
        memory_bytes: address-space limit.
        wall_s: wall-clock limit; the process group is killed when it is reached.
        file_size_bytes: largest file the program may write (its stdout/stderr included).
        max_procs: RLIMIT_NPROC: tasks (processes and threads) of the sandbox uid. Only
            effective for a dropped uid; without root it counts all of the user's processes.
        max_open_files: RLIMIT_NOFILE.
        max_output_bytes: how much of stdout/stderr to return.
        drop_privileges: run as a fresh unprivileged uid; default: when running as root.
        network_namespace: isolate the network with `unshare --net` when it works here.
        audit_hook: install the audit-hook guard (turn off only to test the other layers).
        python: interpreter for the child; default: one the sandbox uid can execute.

    Returns:
        A `SandboxResult`; the working directory is gone and no child process survives.
    """
    drop = os.geteuid() == 0 if drop_privileges is None else bool(drop_privileges)
    if drop and os.geteuid() != 0:
        raise ValueError("run_python_sandboxed: drop_privileges=True needs root; pass None or False")
    python = python or _default_python(drop)
    plan = _launch_plan(drop, network_namespace, python)
    if plan is None:
        raise RuntimeError(f"run_python_sandboxed: cannot start {python!r} -I -S; pass python=")
    prefix, drop_mode = plan
    if drop and drop_mode is None and python not in _WARNED:
        _WARNED.add(python)
        logger.warning("sandbox: cannot run %s as an unprivileged uid; running without that layer", python)
    uid = random.randrange(*_UID_RANGE) if drop_mode else None
    if drop_mode == "unshare":
        prefix = tuple(str(uid) if part == "65534" else part for part in prefix)
    test_list = [tests] if isinstance(tests, str) else list(tests or [])
    nonce = secrets.token_hex(16)
    limits = {
        "RLIMIT_CPU": (cpu_s, cpu_s + 1), "RLIMIT_AS": (memory_bytes,) * 2,
        "RLIMIT_FSIZE": (file_size_bytes,) * 2, "RLIMIT_NPROC": (max_procs,) * 2,
        "RLIMIT_NOFILE": (max_open_files,) * 2, "RLIMIT_CORE": (0, 0),
    }
    config = json.dumps({"limits": limits, "task_file": _TASK_FILE, "audit_hook": audit_hook})
    outer = Path(tempfile.mkdtemp(prefix="rlbolt-sandbox-"))
    process = None
    timed_out = False
    try:
        work = outer / "work"
        work.mkdir(mode=0o700)
        (work / _TASK_FILE).write_text(json.dumps({"solution": code, "tests": test_list, "nonce": nonce}))
        launcher = outer / "launcher.py"
        shutil.copyfile(_LAUNCHER, launcher)
        if uid is not None:
            os.chmod(outer, 0o711)  # the sandbox uid may traverse, not list, the outer dir
            os.chmod(launcher, 0o644)
            os.chown(work, uid, uid)
            os.chown(work / _TASK_FILE, uid, uid)
        (outer / "stdin").write_text(stdin or "")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
        drop_kwargs = {"user": uid, "group": uid, "extra_groups": []} if drop_mode == "popen" else {}
        with open(outer / "stdin", "rb") as stdin_file, open(outer / "stdout", "wb") as out_file, \
                open(outer / "stderr", "wb") as err_file:
            process = subprocess.Popen(
                [*prefix, python, "-I", "-S", str(launcher), str(work), config],
                stdin=stdin_file, stdout=out_file, stderr=err_file, cwd=work, env=env,
                start_new_session=True, close_fds=True, **drop_kwargs,
            )
            try:
                process.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
        return _finish(process, outer, timed_out, wall_s, nonce, len(test_list), max_output_bytes)
    finally:
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # leftovers in the group, even after a clean exit
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
            _kill_leftovers(process.pid, uid)
        shutil.rmtree(outer, ignore_errors=True)


def _finish(process, outer: Path, timed_out: bool, wall_s: float, nonce: str, total: int,
            max_output_bytes: int) -> SandboxResult:
    if timed_out:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just as the clock ran out
            pass
    returncode = process.wait()
    stdout_all = _read(outer / "stdout", 1 << 30)
    stderr = _read(outer / "stderr", max_output_bytes)
    report = re.findall(rf"^{nonce} (\d+) (\d+)$", stdout_all, re.MULTILINE)
    stdout = re.sub(rf"\n?{nonce} \d+ \d+\n", "", stdout_all)[:max_output_bytes]
    passed = int(report[-1][0]) if report and not timed_out else 0
    reported = bool(report) and not timed_out
    if not timed_out and returncode == 0 and reported and passed == total:
        reason, ok = "ok", True
    elif not timed_out and returncode == 0 and reported:
        reason, ok = f"tests failed: {passed} of {total} passed", False
    elif not timed_out and returncode == 0:
        reason, ok = _NO_REPORT, False
    else:
        reason, ok = _reason(None if timed_out else returncode, timed_out, wall_s, stderr), False
    return SandboxResult(ok=ok, returncode=returncode, stdout=stdout, stderr=stderr,
                         timed_out=timed_out, reason=reason, tests_passed=passed,
                         tests_total=total, pid=process.pid)


def extract_code(completion: str, *, language: str = "python") -> str:
    """The last fenced code block (```python ... ``` preferred), else the whole completion."""
    blocks = re.findall(rf"```{language}[^\n]*\n(.*?)```", completion, re.DOTALL | re.IGNORECASE)
    blocks = blocks or re.findall(r"```[^\n]*\n(.*?)```", completion, re.DOTALL)
    return blocks[-1] if blocks else completion


def code_reward(
    completion: str,
    sample: Mapping[str, Any],
    *,
    tests_key: str = "tests",
    partial_credit: bool = True,
    penalty: float = 0.0,
    **sandbox_options: Any,
) -> float:
    """Runs the completion's code against the sample's tests in the sandbox.

    Args:
        completion: the generated text; its last fenced code block is the program.
        sample: the prompt row; `sample[tests_key]` is test source (one test) or a list of
            test strings (e.g. `["assert add(1, 2) == 3", ...]`).
        tests_key: which field holds the tests.
        partial_credit: score the fraction of tests passed; otherwise 1.0 only if all pass.
        penalty: score when the program cannot be judged (crash before the tests, time-out,
            resource limit).
        **sandbox_options: passed to `run_python_sandboxed` (`wall_s`, `cpu_s`, ...).

    Returns:
        `passed / total` (or 1.0/0.0), or `penalty` when the harness never reported.
    """
    if tests_key not in sample:
        raise KeyError(
            f"code_reward: the sample has no field {tests_key!r} (fields: {sorted(sample)}); "
            "pass tests_key= to name the field holding the tests"
        )
    result = run_python_sandboxed(extract_code(completion), tests=sample[tests_key], **sandbox_options)
    if result.ok:
        return 1.0
    if result.timed_out or result.returncode != 0 or result.reason == _NO_REPORT or not result.tests_total:
        return float(penalty)  # the program never reached its tests: nothing to grade
    return result.tests_passed / result.tests_total if partial_credit else 0.0
