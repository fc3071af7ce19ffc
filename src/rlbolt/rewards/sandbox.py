"""Run untrusted Python (a model's code answer) and score it where the code cannot reach.

The score is computed in the trusted parent, never in the process that runs the program:

1. `code_tests.parse_tests` splits each test into the call the program must evaluate
   (``add(1, 2)``) and the expected value (``3``). Only the calls go to the child; the expected
   values, and any notion of how many tests passed, stay here.
2. The child (`_sandbox_launcher.py`) runs the program, evaluates each call and writes each
   value as one JSON line to a pipe. The parent reads at most `max_result_bytes`, rejects any
   malformed, duplicated or out-of-range line (the program shares the child's memory and can
   write there too), decodes each value as a Python literal and compares it itself.

So reaching into the runner's frame, searching `gc.get_objects()` or memory for the tests, or
printing a forged result line finds nothing to forge: the worst a program can do is report
values, and a wrong value fails.

Defence in depth keeps the program from harming the host (`sandbox_isolation.py` picks what
this host allows and every result lists it in `layers`): bubblewrap, or our own user, pid,
network, mount, IPC and UTS namespaces with a read-only view of the filesystem and private
tmpfs; a fresh uid when running as root; resource limits (CPU, address space, file size,
processes, open files, no core dumps); a wall clock; a new session; an audit hook as a last
tripwire (never the only layer: Python code can evade it); and afterwards every process of the
run killed and its temporary files deleted.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbolt.rewards import sandbox_isolation as iso
from rlbolt.rewards.code_tests import CallCheck, IOCheck, decode_value, parse_tests

__all__ = ["SandboxResult", "code_reward", "extract_code", "run_python_sandboxed", "score_result"]

MiB = 1 << 20


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        ok: exited 0 within the limits, every test reported and passed.
        returncode: the child's exit status (negative: killed by that signal), None if unknown.
        stdout: captured standard output (truncated to the output limit).
        stderr: captured standard error (truncated).
        timed_out: the wall-clock limit was reached and the process group was killed.
        reason: one line saying why the run is not ok, or "ok".
        tests_passed: how many tests the parent judged passed.
        tests_total: how many tests were given.
        judged: the run ended cleanly and reported every test, so `tests_passed` is a grade
            (False: crash, limit, time-out, or a broken report).
        pid: the child's pid, also its process-group id (all of it is gone when this returns).
        layers: the isolation layers that were active (see `sandbox_isolation`).
    """

    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    reason: str
    tests_passed: int = 0
    tests_total: int = 0
    judged: bool = False
    pid: int = -1
    layers: tuple[str, ...] = ()


class _Reader(threading.Thread):
    """Drains the results pipe; keeps at most `limit` bytes (more marks an overflow)."""

    def __init__(self, fd: int, limit: int):
        super().__init__(daemon=True)
        self.fd, self._limit = fd, limit
        self.data = bytearray()
        self.overflow = False

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            if len(self.data) + len(chunk) > self._limit:
                self.overflow = True
            else:
                self.data += chunk
        os.close(self.fd)


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


def _read_reports(raw: bytes, calls: int, io_cases: int) -> tuple[dict, dict, str | None]:
    """(values by call, outputs by io case, protocol error or None) from the child's lines."""
    values: dict[int, tuple[bool, Any]] = {}
    outputs: dict[int, Any] = {}
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return {}, {}, "the report is not UTF-8"
    for line in lines:
        try:
            message = json.loads(line)
        except ValueError:
            return {}, {}, f"a report line is not JSON: {line[:80]!r}"
        if not isinstance(message, dict) or len(message) != 2:
            return {}, {}, f"a report line has the wrong shape: {line[:80]!r}"
        kind, total, table = ("call", calls, values) if "call" in message else ("io", io_cases, outputs)
        number = message.get(kind)
        if type(number) is not int or not 0 <= number < total or number in table:
            return {}, {}, f"a report line names no pending test: {line[:80]!r}"
        if "error" in message:
            table[number] = (False, None) if kind == "call" else None
        elif kind == "call" and isinstance(message.get("value"), str):
            table[number] = decode_value(message["value"])
        elif kind == "io" and isinstance(message.get("stdout"), str):
            table[number] = message["stdout"]
        else:
            return {}, {}, f"a report line has the wrong fields: {line[:80]!r}"
    return values, outputs, None


def _grade(checks: list, values: dict, outputs: dict) -> int:
    passed, call, case = 0, 0, 0
    for check in checks:
        if isinstance(check, CallCheck):
            decoded, value = values.get(call, (False, None))
            passed += bool(decoded and check.passes(value))
            call += 1
        else:
            passed += bool(case in outputs and check.passes(outputs[case]))
            case += 1
    return passed


def run_python_sandboxed(
    code: str,
    *,
    stdin: str | None = None,
    tests: str | Sequence[Any] | None = None,
    cpu_s: int = 2,
    memory_bytes: int = 512 * MiB,
    wall_s: float = 5.0,
    file_size_bytes: int = 1 * MiB,
    max_procs: int = 16,
    max_open_files: int = 64,
    max_output_bytes: int = 64 * 1024,
    max_result_bytes: int = 1 * MiB,
    tmpfs_bytes: int = 16 * MiB,
    drop_privileges: bool | None = None,
    isolation: str = "auto",
    audit_hook: bool = True,
    python: str | None = None,
) -> SandboxResult:
    """Runs `code` in a sandboxed child and grades `tests` in this process (module docstring).

    Args:
        code: the program's source.
        stdin: text fed to the program's standard input (empty when None).
        tests: one test or a sequence of tests, in the forms `code_tests.parse_tests` accepts
            (``"assert add(1, 2) == 3"``, ``{"stdin": ..., "stdout": ...}``, ...).
        cpu_s: CPU-time limit in seconds (SIGXCPU, then SIGKILL one second later).
        memory_bytes: address-space limit.
        wall_s: wall-clock limit; the process group is killed when it is reached.
        file_size_bytes: largest file the program may write (its stdout/stderr included).
        max_procs: RLIMIT_NPROC: tasks (processes and threads) of the sandbox uid; only
            tight for a fresh uid (root); otherwise it counts all of the user's tasks.
        max_open_files: RLIMIT_NOFILE.
        max_output_bytes: how much of stdout/stderr to return.
        max_result_bytes: most bytes of reported test values read; more fails the run.
        tmpfs_bytes: size of each private tmpfs (/tmp, /dev/shm) with bwrap or namespaces.
        drop_privileges: run as a fresh unprivileged uid; default: when running as root.
        isolation: "auto" (strongest that works here), "bwrap", "namespaces" or "none"
            (see `sandbox_isolation`).
        audit_hook: install the audit-hook tripwire (turn off only to test the other layers).
        python: interpreter for the child; default: one the sandbox uid can execute.

    Returns:
        A `SandboxResult`; no process of the run is alive and nothing of it is left on disk.

    Raises:
        ValueError: a test in no accepted form, an unknown `isolation`, or
            `drop_privileges=True` without root.
    """
    checks = parse_tests(tests)
    drop = os.geteuid() == 0 if drop_privileges is None else bool(drop_privileges)
    if drop and os.geteuid() != 0:
        raise ValueError("run_python_sandboxed: drop_privileges=True needs root; pass None or False")
    python = python or iso.python_for(drop)
    backend, namespace_layers = iso.choose(isolation, python, drop)
    layers = tuple(namespace_layers) + iso.host_layers(backend, drop, audit_hook=audit_hook)
    uid = random.randrange(*iso.UID_RANGE) if drop else None
    outer = Path(tempfile.mkdtemp(prefix="rlbolt-sandbox-"))
    process, reader, timed_out, ended = None, None, False, False
    try:
        workdir = iso.WORKDIR_IN_NAMESPACE if backend != "none" else str(outer / "work")
        if backend == "none":
            os.mkdir(workdir, 0o700)
            if uid is not None:
                os.chmod(outer, 0o711)  # the sandbox uid may traverse, not list, the outer dir
                os.chown(workdir, uid, uid)
        task = {"code": code, "calls": [c.call for c in checks if isinstance(c, CallCheck)],
                "io": [c.stdin for c in checks if isinstance(c, IOCheck)]}
        (outer / "task.json").write_text(json.dumps(task))
        (outer / "stdin").write_text(stdin or "")
        read_end, write_end = os.pipe()
        reader = _Reader(read_end, max_result_bytes)
        task_fd = os.open(outer / "task.json", os.O_RDONLY)
        limits = {
            "RLIMIT_CPU": (cpu_s, cpu_s + 1), "RLIMIT_AS": (memory_bytes,) * 2,
            "RLIMIT_FSIZE": (file_size_bytes,) * 2, "RLIMIT_NPROC": (max_procs,) * 2,
            "RLIMIT_NOFILE": (max_open_files,) * 2, "RLIMIT_CORE": (0, 0),
        }
        config = {"namespaces": backend == "namespaces", "task_fd": task_fd, "results_fd": write_end,
                  "workdir": workdir, "tmpfs_bytes": tmpfs_bytes, "limits": limits, "audit_hook": audit_hook}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        try:
            with open(outer / "stdin", "rb") as stdin_file, open(outer / "stdout", "wb") as out_file, \
                    open(outer / "stderr", "wb") as err_file:
                process = subprocess.Popen(
                    iso.launcher_command(backend, python, config, tmpfs_bytes),
                    stdin=stdin_file, stdout=out_file, stderr=err_file, cwd="/", env=env,
                    start_new_session=True, close_fds=True, pass_fds=(task_fd, write_end),
                    **iso.drop_kwargs(uid),
                )
        finally:
            os.close(task_fd)
            os.close(write_end)
        reader.start()
        try:
            process.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _end(process, uid, backend)
        ended = True
        reader.join(timeout=5.0)
        returncode = process.returncode
        if backend == "bwrap" and 128 < returncode <= 128 + 64:  # bwrap reports a signal as 128 + n
            returncode = 128 - returncode
        return _finish(returncode, process.pid, outer, checks, reader, timed_out, wall_s, max_output_bytes, layers)
    finally:
        if process is not None and not ended:
            _end(process, uid, backend)
        if process is None and reader is not None:  # the child never started: nor did the reader
            os.close(reader.fd)
        shutil.rmtree(outer, ignore_errors=True)


def _end(process: subprocess.Popen, uid: int | None, backend: str) -> None:
    """Kills the run's process group (leftovers too, even after a clean exit) and reaps it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    iso.kill_leftovers(process.pid, uid)
    if backend == "none" and uid is not None:
        iso.remove_files_of(uid)


def _finish(returncode: int, pid: int, outer: Path, checks: list, reader: _Reader, timed_out: bool, wall_s: float,
            max_output_bytes: int, layers: tuple[str, ...]) -> SandboxResult:
    with open(outer / "stdout", "rb") as handle:
        stdout = handle.read(max_output_bytes).decode("utf-8", errors="replace")
    with open(outer / "stderr", "rb") as handle:
        stderr = handle.read(max_output_bytes).decode("utf-8", errors="replace")
    calls = sum(isinstance(c, CallCheck) for c in checks)
    values, outputs, protocol = _read_reports(bytes(reader.data), calls, len(checks) - calls)
    if reader.overflow:
        protocol = "the report exceeded max_result_bytes"
    clean = not timed_out and returncode == 0
    complete = len(values) == calls and len(outputs) == len(checks) - calls
    judged = clean and protocol is None and complete
    passed = _grade(checks, values, outputs) if judged else 0
    if not clean:
        reason = _reason(None if timed_out else returncode, timed_out, wall_s, stderr)
    elif protocol is not None:
        reason = f"broken report: {protocol}"
    elif not complete:
        reason = f"the program ended before reporting every test ({len(values) + len(outputs)} of {len(checks)})"
    else:
        reason = "ok" if passed == len(checks) else f"tests failed: {passed} of {len(checks)} passed"
    return SandboxResult(ok=reason == "ok", returncode=returncode, stdout=stdout, stderr=stderr,
                         timed_out=timed_out, reason=reason, tests_passed=passed, tests_total=len(checks),
                         judged=judged, pid=pid, layers=layers)


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
    """Runs the completion's code in the sandbox and grades the sample's tests here.

    Args:
        completion: the generated text; its last fenced code block is the program.
        sample: the prompt row; `sample[tests_key]` holds the tests (one, or a list), in the
            forms `code_tests.parse_tests` accepts, e.g. `["assert add(1, 2) == 3", ...]`.
        tests_key: which field holds the tests.
        partial_credit: score the fraction of tests passed; otherwise 1.0 only if all pass.
        penalty: score when the program cannot be judged (crash before its tests, time-out,
            resource limit, a broken report).
        **sandbox_options: passed to `run_python_sandboxed` (`wall_s`, `cpu_s`, ...).

    Returns:
        `passed / total` (or 1.0/0.0), or `penalty` when the run was not judged.
    """
    if tests_key not in sample:
        raise KeyError(
            f"code_reward: the sample has no field {tests_key!r} (fields: {sorted(sample)}); "
            "pass tests_key= to name the field holding the tests"
        )
    result = run_python_sandboxed(extract_code(completion), tests=sample[tests_key], **sandbox_options)
    return score_result(result, partial_credit=partial_credit, penalty=penalty)


def score_result(result: SandboxResult, *, partial_credit: bool = True, penalty: float = 0.0) -> float:
    """The reward `code_reward` gives a run (see there).

    Args:
        result: a sandboxed run.
        partial_credit: the fraction of tests passed; otherwise 1.0 only if all pass.
        penalty: the score of a run that was not judged.

    Returns:
        1.0 when ok; `penalty` when not judged (or no tests); else the fraction (or 0.0).
    """
    if result.ok:
        return 1.0
    if not result.judged or not result.tests_total:
        return float(penalty)
    return result.tests_passed / result.tests_total if partial_credit else 0.0
