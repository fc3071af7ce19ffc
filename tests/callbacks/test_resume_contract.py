"""The resume contract: a run SIGKILLed at a random moment and resumed makes exactly the same
updates as one that never stopped (same metrics.jsonl values outside time/ and throughput/,
bit-identical final params), with each setting the issue names.

Each test runs `resume_script.py` in subprocesses: once uninterrupted (the reference, shared
per setting), once killed after its first checkpoint, once resumed to the end. A persistent
JAX compilation cache shared by the subprocesses keeps the compile cost to the first run (a
cached executable is the same program, so it cannot change a result).
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlbolt.loggers import read_jsonl

SCRIPT = Path(__file__).with_name("resume_script.py")
EXCLUDED_PREFIXES = ("time/", "throughput/")

COMBINED = ("--num_iterations", "2", "--mini_batch_size", "8", "--train_micro_batch_size", "4",
            "--shuffle", "--num_prompts", "6")
SETTINGS = {
    # default run: every sync-mode setting at once, and async mode
    "iterations+accumulation+shuffle+epochs": COMBINED,
    "async": ("--mode", "async", "--max_staleness", "2", "--shuffle", "--num_prompts", "10"),
    # one setting at a time (slow)
    "num_iterations": ("--num_iterations", "3", "--mini_batch_size", "16"),
    "grad_accumulation": ("--mini_batch_size", "8", "--train_micro_batch_size", "2"),
    "shuffle": ("--shuffle",),
    "epoch_boundary": ("--num_prompts", "6"),
    "async_accumulation_iterations": ("--mode", "async", "--max_staleness", "7", "--num_iterations", "2",
                                      "--mini_batch_size", "8", "--train_micro_batch_size", "4"),
    "sync_save": ("--sync_save", "--shuffle"),
    # LoRA: the checkpoint holds the adapters, the base is rebuilt and checked by its fingerprint
    "lora": ("--lora", "--num_iterations", "2", "--mini_batch_size", "8", "--train_micro_batch_size", "4",
             "--shuffle", "--num_prompts", "10"),
}
# The default run kills at a random moment in the combined sync setting and mid-save in async
# mode (test_sigkill_during_save_...); everything else is marked slow.
FAST = ("iterations+accumulation+shuffle+epochs",)
STEPS = 8


@pytest.fixture(scope="session")
def script_env(tmp_path_factory):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, script_env):
    """setting -> run dir of an uninterrupted run (computed once per setting)."""
    cache: dict[str, Path] = {}

    def get(setting: str) -> Path:
        if setting not in cache:
            run_dir = tmp_path_factory.mktemp(f"reference-{setting.replace('+', '-')}")
            run_script(run_dir, SETTINGS[setting], script_env)
            cache[setting] = run_dir
        return cache[setting]

    return get


def run_script(run_dir: Path, flags, env, extra=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--run_dir", str(run_dir), "--steps", str(STEPS), *flags, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    return proc


def finalized_steps(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


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


def assert_same_run(reference: Path, resumed: Path) -> None:
    """Every metric outside time/ and throughput/ equal at every step; final params bit-identical.
    Lines logged twice (by the killed run, then again after the resume) must each match."""
    expected = {r["step"]: r for r in read_jsonl(reference / "metrics.jsonl")}
    assert sorted(expected) == list(range(1, STEPS + 1))
    lines = read_jsonl(resumed / "metrics.jsonl", merge_steps=False)
    assert sorted({r["step"] for r in lines}) == list(range(1, STEPS + 1))
    for line in lines:
        want = expected[line["step"]]
        keys = {k for k in want if not k.startswith(EXCLUDED_PREFIXES)}
        assert keys == {k for k in line if not k.startswith(EXCLUDED_PREFIXES)}, f"step {line['step']}: metric names differ"
        for k in keys:
            same = line[k] == want[k] or (isinstance(want[k], float) and math.isnan(want[k]) and math.isnan(line[k]))
            assert same, f"step {line['step']}: {k} = {line[k]!r} after resume, {want[k]!r} uninterrupted"
    with np.load(reference / "final_params.npz") as a, np.load(resumed / "final_params.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            assert a[name].dtype == b[name].dtype
            assert a[name].tobytes() == b[name].tobytes(), f"final params {name} differ after resume"


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

    from rlbolt.callbacks.checkpoint_io import CheckpointIO

    io = CheckpointIO(run_dir / "checkpoints", async_save=False)
    assert io.steps() == [1, 2]
    io.close()
    run_script(run_dir, SETTINGS[setting], script_env)
    assert_same_run(reference_runs(setting), run_dir)
    assert not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir())
