"""The resume contract: a run SIGKILLed at a random moment and resumed makes exactly the same
updates as one that never stopped (same metrics.jsonl values outside time/ and throughput/,
bit-identical final params), with each setting the issue names.

Each test runs `resume_script.py` in subprocesses: once uninterrupted (the reference, shared
per setting), once killed after its first checkpoint, once resumed to the end. A persistent
JAX compilation cache shared by the subprocesses keeps the compile cost to the first run (a
cached executable is the same program, so it cannot change a result).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resume_helpers import SCRIPT, SETTINGS, STEPS, assert_same_run, finalized_steps, run_script

# The default run kills at a random moment in the combined sync setting and mid-save in async
# mode (test_sigkill_during_save_...); everything else is marked slow.
FAST = ("iterations+accumulation+shuffle+epochs",)


def run_and_kill(run_dir: Path, flags, env, rng: random.Random) -> float:
    """Starts the script, SIGKILLs it at a random moment after its first checkpoint is on disk."""
    cmd = [sys.executable, str(SCRIPT), "--run_dir", str(run_dir), "--steps", str(STEPS), "--step_sleep", "0.3", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not finalized_steps(run_dir):
        assert proc.poll() is None, f"the run ended before its first checkpoint:\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint appeared within 240 s"
        time.sleep(0.02)
    delay = rng.uniform(0.0, 1.5)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, (
        f"the run finished before the kill (delay {delay:.2f} s): raise STEPS or --step_sleep")
    return delay


def _check_resume(setting, tmp_path, script_env, reference_runs):
    rng = random.Random(f"{setting}-{os.getpid()}")
    run_dir = tmp_path / "run"
    delay = run_and_kill(run_dir, SETTINGS[setting], script_env, rng)
    killed_at = finalized_steps(run_dir)
    assert killed_at and killed_at[-1] < STEPS, f"killed after {delay:.2f} s with checkpoints {killed_at}"
    proc = run_script(run_dir, SETTINGS[setting], script_env)
    assert f"finished step={STEPS}" in proc.stdout
    assert_same_run(reference_runs(setting), run_dir)


@pytest.mark.parametrize("setting", FAST)
def test_sigkill_and_resume_matches_uninterrupted_run(setting, tmp_path, script_env, reference_runs):
    _check_resume(setting, tmp_path, script_env, reference_runs)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [s for s in SETTINGS if s not in FAST])
def test_sigkill_and_resume_each_setting(setting, tmp_path, script_env, reference_runs):
    _check_resume(setting, tmp_path, script_env, reference_runs)


@pytest.mark.parametrize("setting", ["async", pytest.param("iterations+accumulation+shuffle+epochs", marks=pytest.mark.slow)])
def test_sigkill_during_save_keeps_previous_checkpoints_usable(setting, tmp_path, script_env, reference_runs):
    """Killed after step 3's files are written but before Orbax renames the step into place: step 3
    is only a tmp dir, steps 1-2 are intact, and resuming from step 2 still matches."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(SCRIPT), "--run_dir", str(run_dir), "--steps", str(STEPS), *SETTINGS[setting],
           "--kill_in_save", "3"]
    proc = subprocess.run(cmd, env=script_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    assert (run_dir / "killed_in_save").read_text() == "3"
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert any(n.startswith("3.") and "tmp" in n for n in names), names
    assert finalized_steps(run_dir) == [1, 2]

    from rlbolt.checkpointing.io import CheckpointIO

    io = CheckpointIO(run_dir / "checkpoints", async_save=False)
    assert io.steps() == [1, 2]
    io.close()
    run_script(run_dir, SETTINGS[setting], script_env)
    assert_same_run(reference_runs(setting), run_dir)
    assert not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir())
