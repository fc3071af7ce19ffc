"""Shared by the resume tests (tests/callbacks/test_resume_contract.py, test_signal_resume.py):
the training script they run in subprocesses, its settings, and the comparison of a resumed
run with an uninterrupted one (every metric outside time/ and throughput/, and the final
parameters, bit for bit)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from rlbolt.loggers import read_jsonl

SCRIPT = Path(__file__).parent / "callbacks" / "resume_script.py"
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
STEPS = 8


def run_script(run_dir: Path, flags, env, extra=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--run_dir", str(run_dir), "--steps", str(STEPS), *flags, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    return proc


def finalized_steps(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


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
