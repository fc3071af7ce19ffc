"""SIGINT / SIGTERM at random moments (many during an asynchronous checkpoint write) stop a real
training process with 130 / 143 after saving its last completed step, and the resumed run is
the same as one that never stopped (metrics outside time/ and throughput/, final parameters bit
for bit). A second signal ends the process at once.

The processes run `resume_script.py` (a Python-API script: it exits 128 + signum when fit
reports an interruption, as docs/howto/resume.md suggests). The command-line demo's exit codes
and message are tested in tests/cli/test_cli_faults.py (the default-tier representative) and
the in-process stop in tests/core/test_signals.py; everything here is `slow`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from resume_helpers import SCRIPT, SETTINGS, STEPS, assert_same_run, finalized_steps, run_script

from rlbolt.loggers import read_jsonl

SETTING = "iterations+accumulation+shuffle+epochs"


def start(run_dir, env, *extra):
    cmd = [sys.executable, str(SCRIPT), "--run_dir", str(run_dir), "--steps", str(STEPS), *SETTINGS[SETTING], *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc, run_dir, timeout=240):
    deadline = time.monotonic() + timeout
    while not finalized_steps(run_dir):
        assert proc.poll() is None, f"the run ended before its first checkpoint:\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"no checkpoint appeared within {timeout} s"
        time.sleep(0.02)


def last_logged_step(run_dir) -> int:
    return max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl"))


def check_stopped_cleanly(proc, run_dir, signum):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, f"exit {proc.returncode}:\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    stopped = int(out.split("interrupted step=")[1].split()[0])
    # The last completed step is the one saved, and the one last logged.
    assert finalized_steps(run_dir)[-1] == stopped == last_logged_step(run_dir)
    return stopped


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("trial", range(3))
def test_signal_at_a_random_moment_saves_the_last_step_and_resumes_exactly(signum, trial, tmp_path, script_env,
                                                                            reference_runs):
    rng = random.Random(f"{signum}-{trial}-{os.getpid()}")
    run_dir = tmp_path / "run"
    proc = start(run_dir, script_env, "--step_sleep", "0.3")
    wait_for_checkpoint(proc, run_dir)
    time.sleep(rng.uniform(0.0, 1.2))  # every step checkpoints asynchronously: often mid-write
    proc.send_signal(signum)
    stopped = check_stopped_cleanly(proc, run_dir, signum)
    assert stopped < STEPS, "the run finished before the signal: raise --step_sleep"
    run_script(run_dir, SETTINGS[SETTING], script_env)
    assert_same_run(reference_runs(SETTING), run_dir)


@pytest.mark.slow
def test_signal_during_a_checkpoint_write(tmp_path, script_env, reference_runs):
    """SIGTERM while step 3's files are written and not yet renamed into place: the write
    completes, the run stops after the step it was in, and that step is saved too."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, script_env, "--signal_in_save", "3")
    stopped = check_stopped_cleanly(proc, run_dir, signal.SIGTERM)
    assert (run_dir / "signalled_in_save").read_text() == "3" and 3 in finalized_steps(run_dir)
    assert 3 <= stopped < STEPS
    run_script(run_dir, SETTINGS[SETTING], script_env)
    assert_same_run(reference_runs(SETTING), run_dir)


@pytest.mark.slow
def test_second_signal_exits_at_once_without_saving(tmp_path, script_env):
    """The first SIGTERM asks for a stop after the step (which sleeps 5 s in a callback); the
    second one ends the process within a second, quietly, killed by the signal (the shell's 143).

    The first signal goes at the start of a step's sleep (the script's `sleeping` marker names a
    step after the first checkpoint): sent at a random moment, it could land at the end of a sleep,
    so that the fit ended within the 0.5 s before the second signal and the second one met the
    default disposition of a process past its fit (-15, seen once under load)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, script_env, "--step_sleep", "5")
    wait_for_checkpoint(proc, run_dir)
    marker = run_dir / "sleeping"
    seen = marker.read_text() if marker.exists() else None
    deadline = time.monotonic() + 60
    while (marker.read_text() if marker.exists() else None) == seen:  # a new sleep has begun
        assert proc.poll() is None and time.monotonic() < deadline, "no step ended within 60 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 1.0
    assert proc.returncode == -signal.SIGTERM  # killed by it: the shell's 143
    assert "interrupted step=" not in out  # fit never returned: nothing after the second signal
    assert "SIGTERM received: stopping after the current step" in err and "Traceback" not in err
    assert finalized_steps(run_dir)  # the checkpoints already written are intact
