"""The command line under the faults of a shared cluster, on real `rlbolt demo` processes:

- SIGTERM (SIGINT: slow) mid-run: exit 143 (130), one line saying where to resume, the last completed step saved,
  and `rlbolt resume` then matches a run that never stopped (every metric outside time/ and
  throughput/, each step logged once, and the exported weights byte for byte);
- a second writer (`rlbolt resume` while the run trains) is refused with exit 2 naming the PID
  (checked on the reference run);
- `rlbolt export` in a loop while a run checkpoints every step: the run finishes normally and
  every export succeeds or fails with one line (readers never touch the writer's files);
- a full disk while a checkpoint is written (injected ENOSPC; a real small tmpfs when the test
  may mount one; both slow): exit 1 with exactly one line on stderr (no Orbax noise), the
  finished checkpoints intact, and an exact resume once there is space again.

The runs share a persistent JAX compilation cache (the same program, so results cannot change).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbolt.loggers import read_jsonl

STEPS = 20
EXCLUDED = ("time/", "throughput/")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    out = dict(os.environ)
    out.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    out.pop("RLBOLT_DEBUG", None)
    return out


def rlbolt(*args: str, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlbolt", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def start_demo(run_dir: Path, env, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlbolt", "demo", "--run-dir", str(run_dir), "--max-steps",
                             str(STEPS), "--no-progress", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path, merge_steps=False) if "reward/mean" in r] if path.exists() else []


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(logged_steps(run_dir)) < n:
        assert proc.poll() is None, f"the run ended early:\n{proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout} s"
        time.sleep(0.05)


def steps_on_disk(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """An uninterrupted demo run that checkpoints every step while `rlbolt export` reads it in a
    loop (in-process, the same code path, to keep the test cheap)."""
    from rlbolt.app.cli_export import export_run

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = start_demo(run_dir, env, "--checkpoint-every", "1")
    outcomes = []
    wait_for_steps(proc, run_dir, 1)
    second = rlbolt("resume", str(run_dir), env=env)  # a second writer while the demo trains
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"in use by another rlbolt process (PID {proc.pid}" in second.stderr
    out = run_dir.parent / "exports"
    while proc.poll() is None:
        try:
            _, step = export_run(run_dir, out / str(len(outcomes)))
            outcomes.append(step)
        except Exception as error:  # noqa: BLE001 - each failure must be a one-line refusal
            from rlbolt.app.rundir import RunDirError
            from rlbolt.checkpointing.io import NoUsableCheckpoint

            assert isinstance(error, (NoUsableCheckpoint, RunDirError)), repr(error)
            assert "\n" not in str(error)
            outcomes.append(error)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return run_dir, outcomes


def test_export_in_a_loop_while_training_never_disturbs_the_run_and_a_second_writer_is_refused(reference):
    run_dir, outcomes = reference
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    exported = [o for o in outcomes if isinstance(o, int)]
    assert exported, outcomes  # at least one export read a step while the run trained
    assert steps_on_disk(run_dir) == [STEPS - 1, STEPS]  # keep=2; the writer's pruning went on
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_exits_128_plus_signum_saves_the_step_and_resumes_exactly(tmp_path, env, reference, signum):
    run_dir = tmp_path / "run"
    proc = start_demo(run_dir, env)
    wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err[-3000:]
    stopped = logged_steps(run_dir)[-1]
    assert stopped < STEPS, "the run finished before the signal"
    last = err.strip().splitlines()[-1]
    assert last == (f"rlbolt demo: interrupted by {name} after step {stopped}; checkpoint of step {stopped} saved; "
                    f"continue with: rlbolt resume {run_dir}")
    assert "Traceback" not in err
    assert steps_on_disk(run_dir) == [stopped]  # no periodic checkpoints: the stop saved it

    resumed = rlbolt("resume", str(run_dir), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from the checkpoint of step {stopped}" in resumed.stdout

    assert logged_steps(run_dir) == list(range(1, STEPS + 1))  # each step trained and logged once
    assert_matches_reference(run_dir, reference[0], tmp_path, env)


def assert_matches_reference(run_dir: Path, reference_dir: Path, tmp_path: Path, env) -> None:
    """Every logged line (steps logged twice included) equals the reference's, outside time/ and
    throughput/; the exported weights are byte-identical."""
    assert sorted(set(logged_steps(run_dir))) == list(range(1, STEPS + 1))
    want = {r["step"]: r for r in read_jsonl(reference_dir / "metrics.jsonl")}
    for line in read_jsonl(run_dir / "metrics.jsonl", merge_steps=False):
        expected = want[line["step"]]
        assert {k: v for k, v in line.items() if not k.startswith(EXCLUDED)} == \
            {k: v for k, v in expected.items() if not k.startswith(EXCLUDED)}, line["step"]
    assert exported_weights(run_dir, tmp_path / "ours") == exported_weights(reference_dir, tmp_path / "theirs")


def exported_weights(run_dir: Path, out: Path) -> bytes:
    """`rlbolt export`'s function, in-process (the command's own test is tests/cli/test_cli_resume_export.py)."""
    from rlbolt.app.cli_export import export_run

    export_run(run_dir, out)
    return (out / "model.safetensors").read_bytes()


def check_disk_full_then_resume(run_dir: Path, proc: subprocess.CompletedProcess, reference_dir: Path, tmp_path, env,
                                resume=lambda: None) -> None:
    assert proc.returncode == 1, proc.stderr[-3000:]
    (tmp_path / "stderr.txt").write_text(proc.stderr)
    assert proc.stderr.count("\n") == 1, proc.stderr[:3000]  # one line: no Orbax traceback, no shutdown noise
    line = proc.stderr.strip()
    assert line.startswith("rlbolt demo: error: could not write ") and "no space left on device (free " in line, line
    if "could not write the checkpoint of step " in line:  # the disk filled up during a checkpoint write
        assert "this checkpoint needs about" in line and "nothing half-written is used as a checkpoint" in line
        failed = int(line.split("checkpoint of step ")[1].split()[0])
        assert all(s < failed for s in steps_on_disk(run_dir))  # finished checkpoints are intact, the failed one is not one
    else:  # ... or while a run file (metrics.jsonl, train.log) was appended to: cli_run.RunDiskFull
        assert f"finished checkpoints: {sorted(steps_on_disk(run_dir)) or 'none'}, intact" in line, line
        assert line.endswith(f"rlbolt resume {run_dir}"), line
    resume()
    resumed = rlbolt("resume", str(run_dir), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_matches_reference(run_dir, reference_dir, tmp_path, env)


@pytest.mark.slow  # the same fault in-process, in the default tier: tests/callbacks/test_checkpoint_write_errors.py
def test_disk_full_injected_is_one_line_and_resumes_exactly(tmp_path, env, reference):
    run_dir = tmp_path / "run"
    script = Path(__file__).with_name("enospc_rlbolt.py")
    proc = subprocess.run([sys.executable, str(script), "3", "demo", "--run-dir", str(run_dir), "--max-steps", str(STEPS),
                           "--no-progress", "--checkpoint-every", "1"], env=env, capture_output=True, text=True, timeout=300)
    check_disk_full_then_resume(run_dir, proc, reference[0], tmp_path, env)


@pytest.mark.slow
def test_disk_full_on_a_small_tmpfs_is_one_line_and_resumes_exactly(tmp_path, env, reference):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2200k", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        run_dir = mount / "run"  # one checkpoint is ~0.85 MB: the third one does not fit next to two
        proc = rlbolt("demo", "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--no-progress",
                      "--checkpoint-every", "1", env=env)

        def free_space():
            subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)

        check_disk_full_then_resume(run_dir, proc, reference[0], tmp_path, env, resume=free_space)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
