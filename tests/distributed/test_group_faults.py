"""A process of a placement across process groups that dies or stops answering mid-step (sync and async mode).

Each test runs `xproc_checks.py` as 4 processes through `rlbolt launch --local 4` (train on
processes 0, 1, rollout on 2, 3) with one fault injected at step 2 (`RLBOLT_XPROC_FAULT`), and
checks: the launcher exits non-zero within a bound of the fault, in one line naming a process;
no process of the run is left; every line of `metrics.jsonl` is whole JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("xproc_checks.py")
GRACE_S = 5

# Bounds, from the fault (the faulting process's own clock) to the launcher's exit. Measured on a
# 2-core CPU host shared with other jobs: a SIGKILLed rollout or training process, 5.2 s (a training one
# also 0.2 s in another run: the launcher
# sees the exit at once; the others, waiting in the runtime or deferring SIGTERM to a step boundary, stop at
# SIGKILL after the 5 s grace); process 0 (the coordination service's host), 0.9 s (two runs: the others' clients
# lose the service at once); a SIGSTOPped one with a 60 s deadline, 65.3 s. Asserted: 3x the kills'
# 5.2 s; the deadline plus 3x the 5.3 s after it for the stop.
KILL_BOUND_S = 3 * 5.2
DEADLINE_S = 60.0  # above the first step's compile time (the first wait includes the other group's compile)
STOP_BOUND_S = DEADLINE_S + 3 * 5.3
# Async: the rollout group waits for the second push while the training group runs its first step, which compiles
# its programs (80.6 s time/step measured in the async run, with rollout correction's forward): a 60 s deadline ends
# a healthy run there, so 1.5x that. Then the training step it still runs after the fault: 3x the 0.87 s measured.
ASYNC_DEADLINE_S, STEP_S = 1.5 * 80.6, 3 * 0.9


def _launch(out: Path, fault: str, deadline_s: float | None = None, heartbeat_s: int = 30,
            mode: str = "sync") -> tuple[subprocess.CompletedProcess, float]:
    env = child_env(drop=("JAX_", "SLURM_"))
    env["RLBOLT_XPROC_FAULT"] = fault
    env["RLBOLT_XPROC_HEARTBEAT_S"] = str(heartbeat_s)
    if deadline_s is not None:
        env["RLBOLT_XPROC_DEADLINE_S"] = str(deadline_s)
    done = subprocess.run([sys.executable, "-m", "rlbolt", "launch", "--local", "4", "--devices-per-process", "1",
                           "--grace-s", str(GRACE_S), "--", sys.executable, str(SCRIPT), str(out), "--mode", mode],
                          capture_output=True, text=True, env=env, timeout=900)
    ended = time.time()
    (out / "launch_stderr.txt").write_text(done.stderr)  # every process's lines, for a failure's diagnosis
    assert (out / "fault_at").exists(), "the fault was not injected: " + done.stderr[-3000:]
    took = ended - float((out / "fault_at").read_text())
    print(f"{fault}: the launcher exited {took:.1f} s after the fault")
    return done, took


def _check_nothing_left(out: Path, logged: int = 1) -> None:
    pids = [int((out / f"pid_{p}").read_text()) for p in range(4)]
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes of the run still running: {alive}"
    metrics = out / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    for line in lines:
        json.loads(line)  # a half-written line would not parse
    steps = [json.loads(line).get("step") for line in lines]
    assert len(steps) <= logged, steps  # sync: the fault is at step 2, at most step 1 was logged


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("rlbolt launch:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("process", [2, 1, 0], ids=["rollout", "train", "coordinator"])
def test_a_process_killed_mid_step_ends_the_launch_in_one_line(tmp_path, process):
    done, took = _launch(tmp_path, f"kill:{process}")
    assert done.returncode != 0
    line = _one_line(done.stderr)
    assert f"process {process} of 4 was killed by SIGKILL" in line, line
    # its last completed step (step_beacon): a training process dies in the update of step 2, a rollout process
    # in the rollout of step 2
    assert re.search(f"SIGKILL after {'rolled out step 1' if process == 2 else 'step 1'}[:;]", line), line
    assert took < KILL_BOUND_S, f"{took:.1f} s from the kill to the launcher's exit"
    _check_nothing_left(tmp_path)


@pytest.mark.slow
def test_a_rollout_process_killed_mid_put_ends_the_launch_and_no_step_trains_on_its_half_micro_batch(tmp_path):
    # Process 2 dies in the Flight put of step 2's first micro batch after one row of it crossed: the training
    # process's dock applies a put only once its stream is whole (test_group_rows.py checks the dock holds
    # nothing of it, and, without a launcher, the training process's line naming process 2 and its last rows).
    done, took = _launch(tmp_path, "killput:2")
    assert done.returncode != 0
    line = _one_line(done.stderr)
    assert re.search("process 2 of 4 was killed by SIGKILL after rolled out step 1[:;]", line), line
    assert took < KILL_BOUND_S, f"{took:.1f} s from the kill to the launcher's exit"
    _check_nothing_left(tmp_path)  # step 1 at most was trained and logged: not step 2, whose rows were cut


@pytest.mark.slow
def test_a_stopped_rollout_process_ends_the_run_at_the_deadline_naming_it(tmp_path):
    # SIGSTOP: the process is alive (no exit for the launcher to see) and its group waits on it. Its heartbeats
    # stop too; the heartbeat timeout is raised to 300 s here so that the process stands for one that is stuck
    # with its heartbeat thread alive (a hung kernel, a deadlock): without a deadline on the wait between the
    # groups, the run would wait for its rows until that timeout.
    done, took = _launch(tmp_path, "stop:3", deadline_s=DEADLINE_S, heartbeat_s=300)
    assert done.returncode != 0
    line = _one_line(done.stderr)
    # a training process names the rollout process it waited on (3 itself, or 2, which waits on 3's collective)
    assert "trainer.prefetch_timeout_s=60" in line and ("nothing from process 3" in line or
                                                        "nothing from process 2" in line), line
    assert DEADLINE_S < took < STOP_BOUND_S, f"{took:.1f} s from the stop to the launcher's exit"
    _check_nothing_left(tmp_path)


@pytest.mark.slow
def test_a_stopped_rollout_process_in_async_mode_ends_the_run_at_the_deadline_naming_it(tmp_path):
    # Async, lag 1: process 3 stops in its rollout of step 3 (index 2: it joined the push of the weights after 1
    # step, the second push, as in sync mode). Rows of steps 1 and 2 were made, so the training group trains and
    # logs them, then waits at the push of the weights after 2 steps for the rollout group, which never joins.
    done, took = _launch(tmp_path, "stop:3", deadline_s=ASYNC_DEADLINE_S, heartbeat_s=300, mode="async")
    assert done.returncode != 0
    line = _one_line(done.stderr)
    assert f"trainer.prefetch_timeout_s={ASYNC_DEADLINE_S:g}" in line and ("nothing from process 3" in line or
                                                                       "nothing from process 2" in line), line
    # the sync test's bound after the deadline, plus the training step it still runs after the stop (STEP_S)
    bound = ASYNC_DEADLINE_S + (STOP_BOUND_S - DEADLINE_S) + STEP_S
    assert ASYNC_DEADLINE_S < took < bound, f"{took:.1f} s from the stop to the launcher's exit"
    _check_nothing_left(tmp_path, logged=2)
