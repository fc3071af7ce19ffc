"""`rlbolt launch --local N -- rlbolt fit CONFIG ...`: one run over N processes on this machine.

Starts N copies of the command on loopback, each with the environment `jax.distributed` reads
(`rlbolt.distributed.runtime.initialize`: `JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`, `JAX_NUM_PROCESSES=N`,
`JAX_PROCESS_ID=i`; `RLBOLT_TRANSFER_ADDRESS`, a free port each, for the weight push between
process groups), so the copies meet as one multi-process run, as they would on N hosts. Each
output line is prefixed with its process index (`[1] ...`; stderr stays stderr). The first
process that fails stops the others (SIGTERM, then SIGKILL after `--grace-s`) and the launcher
ends with one line naming that process, its exit status, its last completed step (each process
records it in `$RLBOLT_STEP_FILE`, `rlbolt.utils.step_beacon`) and its last line on stderr, and with
its exit status. SIGINT / SIGTERM to the launcher are passed on once to every process (a second
one kills them). Imports no JAX: it only supervises.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from rlbolt.app.arg_types import positive_int
from rlbolt.utils.jax_env import ENV_ADDRESS, ENV_COUNT, ENV_ID, ENV_LOCAL_DEVICES, ENV_TRANSFER
from rlbolt.utils.step_beacon import ENV_STEP_FILE, last_step

# rlbolt subcommands that join a multi-process run (they call `jax.distributed.initialize`); the
# others would run N independent copies.
LAUNCHABLE = ("fit", "resume")
DEFAULT_GRACE_S = 10.0
# Settings of an outer launcher (Slurm, a previous `jax.distributed` environment) that would make a
# copy join the wrong run: removed from the children's environment.
_FOREIGN_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                     "JAX_LOCAL_DEVICE_IDS", "TPU_WORKER")


class LaunchError(ValueError):
    """A `rlbolt launch` command line that cannot start (reported in one line, exit status 2)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlbolt launch` on the `rlbolt` command's subparsers.

    Args:
      sub: the subparsers of `rlbolt.app.cli.build_parser`.
    """
    launch = sub.add_parser(
        "launch", help="start one run as N processes on this machine (jax.distributed on loopback)",
        description="Start N copies of an rlbolt command that meet as one multi-process run on loopback, as on "
                    "N hosts: `rlbolt launch --local 2 -- rlbolt fit CONFIG`. Output lines carry the process index; "
                    "the first failure stops every process. Other launchers (Slurm, Kubernetes, by hand): "
                    "docs/howto/multi-host.md.")
    launch.add_argument("--local", type=positive_int, required=True, metavar="N", help="how many processes (>= 1)")
    launch.add_argument("--devices-per-process", type=positive_int, metavar="D",
                        help="CPU devices each process sees (XLA's host platform device count; default: JAX's, 1)")
    launch.add_argument("--gpus-per-process", type=positive_int, metavar="G",
                        help="GPUs each process takes: process i gets GPUs i*G .. i*G+G-1 ($JAX_LOCAL_DEVICE_IDS); "
                             "default: every process sees every GPU")
    launch.add_argument("--port", type=int, help="the coordinator's port on 127.0.0.1 (default: a free one)")
    launch.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help=f"after a failure, seconds the others get to stop before SIGKILL (default {DEFAULT_GRACE_S:g})")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the command every process runs: `rlbolt fit ...`, `rlbolt resume ...`, or any program "
                             "(e.g. `python train.py`) that calls rlbolt.distributed.initialize()")


def child_command(cmd: Sequence[str]) -> list[str]:
    """The argv each process runs for the words after `--`.

    Args:
      cmd: the command as typed, e.g. `["rlbolt", "fit", "c.yaml"]` (a leading `--` is dropped).

    Returns:
      `rlbolt ...` becomes `<this python> -m rlbolt ...` (the same installation in every copy);
      anything else runs as given.

    Raises:
      LaunchError: no command, or an rlbolt subcommand that does not join a multi-process run.
    """
    words = list(cmd[1:] if cmd[:1] == ["--"] else cmd)
    if not words:
        raise LaunchError("no command to launch; give it after `--`, e.g. `rlbolt launch --local 2 -- rlbolt fit "
                          "config.yaml`")
    if os.path.basename(words[0]) != "rlbolt":
        return words
    sub = words[1] if len(words) > 1 else None
    if sub not in LAUNCHABLE:
        raise LaunchError(f"`rlbolt {sub or ''}` does not run over several processes; launch one of "
                          f"{', '.join('rlbolt ' + s for s in LAUNCHABLE)}")
    return [sys.executable, "-m", "rlbolt", *words[1:]]


def process_env(base: Mapping[str, str], *, index: int, count: int, port: int,
                devices_per_process: int | None, gpus_per_process: int | None = None) -> dict[str, str]:
    """The environment of process `index`: `base` without an outer launcher's settings, plus the
    three `jax.distributed` variables (and the CPU device count when given).

    Args:
      base: the launcher's environment.
      index: this process's index, 0 .. count - 1.
      count: how many processes.
      port: the coordinator's port on 127.0.0.1.
      devices_per_process: CPU devices each process sees, or None for JAX's default.
      gpus_per_process: GPUs each process takes (consecutive, by process index), or None for all.

    Returns:
      A new environment mapping.
    """
    env = {k: v for k, v in base.items() if not k.startswith(_FOREIGN_PREFIXES)}
    env.update({ENV_ADDRESS: f"127.0.0.1:{port}", ENV_COUNT: str(count), ENV_ID: str(index)})
    env[ENV_TRANSFER] = f"127.0.0.1:{free_port()}"  # this process's socket for the weight push between groups
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
    if gpus_per_process is not None:
        env[ENV_LOCAL_DEVICES] = ",".join(str(index * gpus_per_process + g) for g in range(gpus_per_process))
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen
    last_err: str = ""
    pumps: list[threading.Thread] = field(default_factory=list)


def _pump(child: _Child, stream: IO[bytes], out: IO[bytes], lock: threading.Lock, is_err: bool) -> None:
    prefix = f"[{child.index}] ".encode()
    for raw in iter(stream.readline, b""):
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        text = line.decode(errors="replace").strip()
        # a line in parentheses is a note under an exception (e.g. which producer thread raised it): the
        # exception's own line above it says what failed
        if is_err and text and not (text.startswith("(") and text.endswith(")") and child.last_err):
            child.last_err = text
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def run_local(argv: Sequence[str], count: int, *, port: int | None = None, devices_per_process: int | None = None,
              gpus_per_process: int | None = None, grace_s: float = DEFAULT_GRACE_S, env: Mapping[str, str] | None = None,
              stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> int:
    """Runs `argv` as `count` processes of one `jax.distributed` run on loopback and waits.

    Args:
      argv: the program every process runs (`child_command`'s result).
      count: how many processes.
      port: the coordinator's port (default: a free one).
      devices_per_process: CPU devices per process (None: JAX's default).
      gpus_per_process: GPUs per process, consecutive by process index (None: every process sees all).
      grace_s: after the first failure, how long the others get to stop before SIGKILL.
      env: the base environment (default `os.environ`).
      stdout: where the processes' prefixed stdout lines go (default this process's, as bytes).
      stderr: where their prefixed stderr lines and the launcher's one line go.

    Returns:
      0 when every process succeeded; otherwise the exit status of the first process that failed
      (128 + signal for one killed by a signal), or 128 + signum when the launcher was signalled.
    """
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr.buffer
    lock = threading.Lock()
    port = port or free_port()
    base = os.environ if env is None else env
    children: list[_Child] = []
    received: list[int] = []
    steps = tempfile.TemporaryDirectory(prefix="rlbolt-launch-")  # each process's last step (step_beacon)

    def on_signal(signum: int, frame) -> None:
        del frame
        received.append(signum)
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(signum if len(received) == 1 else signal.SIGKILL)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(count):
            env = process_env(base, index=index, count=count, port=port, devices_per_process=devices_per_process,
                              gpus_per_process=gpus_per_process)
            env[ENV_STEP_FILE] = os.path.join(steps.name, f"process_{index}")
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env=env)
            child = _Child(index, proc)
            child.pumps = [threading.Thread(target=_pump, args=(child, s, o, lock, e), daemon=True)
                           for s, o, e in ((proc.stdout, out, False), (proc.stderr, err, True))]
            for t in child.pumps:
                t.start()
            children.append(child)
        failed = _wait_first_failure(children, received)
        if failed is not None and not received:
            _stop(children, grace_s)
        for c in children:
            c.proc.wait()
            for t in c.pumps:
                t.join(timeout=5)
    finally:
        for c in children:  # an exception in the launcher itself leaves no process behind
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    recorded = None if failed is None else last_step(os.path.join(steps.name, f"process_{failed.index}"))
    steps.cleanup()
    if received:
        return 128 + received[0]
    if failed is None:
        return 0
    code = failed.proc.returncode
    status = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    status += f" after {recorded}" if recorded else ""  # nothing recorded: not an rlbolt run, or no step done
    last = f": {failed.last_err}" if failed.last_err else ""
    others = f"; stopped the other {count - 1}" if count > 1 else ""
    with lock:
        err.write(f"rlbolt launch: process {failed.index} of {count} {status}{last}{others}\n".encode())
        err.flush()
    return code if code > 0 else 128 - code


def _wait_first_failure(children: list[_Child], received: list[int]) -> _Child | None:
    """Polls until every process ended (None) or one ended with a non-zero status (that one).
    Once the launcher was signalled, the processes stop on their own (each saves its last step):
    a non-zero status is then expected and nothing more is sent."""
    while True:
        running = False
        for c in children:
            code = c.proc.poll()
            if code is None:
                running = True
            elif code != 0 and not received:
                return c
        if not running:
            return None
        time.sleep(0.05)


def _stop(children: list[_Child], grace_s: float) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            c.proc.kill()


def run_launch(args: argparse.Namespace) -> int:
    """`rlbolt launch` on its parsed arguments; returns the exit status (see `run_local`).

    Args:
      args: the parsed `rlbolt launch` arguments.

    Raises:
      LaunchError: a command that cannot be launched.
    """
    argv = child_command(args.cmd)
    if args.port is not None and not 0 < args.port < 65536:
        raise LaunchError(f"--port {args.port} is not a TCP port; give 1..65535 or leave it out for a free one")
    if args.grace_s < 0:
        raise LaunchError(f"--grace-s {args.grace_s:g} must be >= 0")
    return run_local(argv, args.local, port=args.port, devices_per_process=args.devices_per_process,
                     gpus_per_process=args.gpus_per_process, grace_s=args.grace_s)
