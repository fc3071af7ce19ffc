"""Several real processes on localhost (JAX's distributed runtime, gloo CPU collectives).

Each test starts `mp_worker.py` (or `rlbolt fit`) as separate processes that meet through a
coordinator on a free port; every process sees its own CPU devices and the mesh spans them all.
Float tolerance against the one-process run: gloo sums partial results in another order than
the in-process collectives, so parameters differ by float32 rounding (~1e-7 after Adam's lr 1e-3
steps); sampled tokens, rewards and counters must be identical.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cpu_devices import child_env

WORKER = Path(__file__).with_name("mp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    return child_env(drop=("JAX_", "SLURM_"))  # each worker asks for its devices itself


def launch(out: Path, run_dir: Path, *, processes: int, devices: int, steps: int, extra=()) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for pid in range(processes):
        cmd = [sys.executable, str(WORKER), "--out", str(out), "--run_dir", str(run_dir), "--devices", str(devices),
               "--steps", str(steps), *extra]
        if processes > 1:
            cmd += ["--num_processes", str(processes), "--process_id", str(pid), "--port", str(port)]
        log = open(out.parent / f"{out.name}_{pid}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env()))
    return procs


def finish(procs, out: Path, timeout: float = 900) -> None:
    for pid, proc in enumerate(procs):
        rc = proc.wait(timeout=timeout)
        assert rc == 0, (out.parent / f"{out.name}_{pid}.log").read_text()[-4000:]


def results(out: Path, pid: int = 0) -> tuple[dict, dict]:
    meta = json.loads((out / f"result_{pid}.json").read_text())
    return meta, dict(np.load(out / f"result_{pid}.npz"))


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= atol, worst


def run_files_written(meta: dict, run_dir: Path) -> set[str]:
    return {Path(p).name for p in meta["written"] if str(run_dir.resolve()) in p}


def test_two_processes_train_in_lockstep_and_only_process_0_writes(tmp_path):
    """The default tier's representative: 2 processes x 2 CPU devices (a fsdp=4 mesh), 2 steps."""
    out, run = tmp_path / "out", tmp_path / "run"
    finish(launch(out, run, processes=2, devices=2, steps=2, extra=["--beta", "0"]), out)
    (m0, p0), (m1, p1) = results(out, 0), results(out, 1)
    assert m0["process_count"] == 2 and m0["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tp": 1}
    assert all(np.array_equal(p0[k], p1[k]) for k in p0)  # bitwise: one global computation
    assert m0["steps"] == m1["steps"] and len(m0["steps"]) == 2
    assert m0["data_position"] == m1["data_position"] == 8
    assert run_files_written(m0, run) >= {"metrics.jsonl"}
    assert run_files_written(m1, run) == set()  # process 1 wrote nothing into the run directory
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # written once, not once per process


@pytest.mark.slow
def test_two_processes_equal_one_process_and_resume_on_four_devices(tmp_path):
    pair_out, pair_run = tmp_path / "pair", tmp_path / "pair_run"
    one_out, one_run = tmp_path / "one", tmp_path / "one_run"
    pair = launch(pair_out, pair_run, processes=2, devices=2, steps=4, extra=["--checkpoint_every", "2"])
    finish(pair, pair_out)
    finish(launch(one_out, one_run, processes=1, devices=4, steps=4), one_out)
    (pm, pp), (om, op) = results(pair_out), results(one_out)
    assert [s["reward/mean"] for s in pm["steps"]] == [s["reward/mean"] for s in om["steps"]]
    # two processes x 2 devices against one x 4: the same mesh shape and programs on the same CPU, so the same kernels;
    # only the collectives' summation order of 4 partial sums differs: 4 * eps of |loss| ~ 1, far below 1e-6
    assert np.allclose([s["loss"] for s in pm["steps"]], [s["loss"] for s in om["steps"]], atol=1e-6)
    assert_params_close(pp, op, atol=1e-6)

    # tp=4 across the two processes: the batch is not split between them, both roll out the
    # same prompts (one data share), and the samples are still the one-process run's.
    tp_out = tmp_path / "tp"
    finish(launch(tp_out, tmp_path / "tp_run", processes=2, devices=2, steps=2,
                  extra=["--mesh", json.dumps({"fsdp": 1, "tp": 4})]), tp_out)
    tm, _ = results(tp_out)
    assert tm["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tp": 4}
    assert [s["reward/mean"] for s in tm["steps"]] == [s["reward/mean"] for s in om["steps"][:2]]

    # The pair's checkpoint of step 2 restores in ONE process on 4 devices laid out fsdp=2 x tp=2.
    resumed_run = tmp_path / "resumed_run"
    resumed_run.mkdir()
    (resumed_run / "checkpoints").mkdir()
    os.rename(pair_run / "checkpoints" / "2", resumed_run / "checkpoints" / "2")
    resumed_out = tmp_path / "resumed"
    finish(launch(resumed_out, resumed_run, processes=1, devices=4, steps=4,
                  extra=["--checkpoint_every", "2", "--mesh", json.dumps({"fsdp": 2, "tp": 2})]), resumed_out)
    rm, rp = results(resumed_out)
    assert rm["restored_step"] == 2 and rm["mesh"] == {"data": 1, "fsdp": 2, "expert": 1, "context": 1, "tp": 2}
    restored, saved = np.load(resumed_out / "restored_0.npz"), np.load(pair_out / "step2_0.npz")
    assert all(np.array_equal(restored[k], saved[k]) for k in saved)  # the restore itself is exact
    # ... and the run continues as the pair did: same samples, same counters, params to rounding.
    assert [s["reward/mean"] for s in rm["steps"]] == [s["reward/mean"] for s in pm["steps"][2:]]
    assert (rm["data_position"], rm["policy_version"]) == (pm["data_position"], pm["policy_version"])
    assert_params_close(rp, pp, atol=1e-6)


@pytest.mark.slow
def test_a_killed_process_makes_the_other_exit_with_an_error_soon(tmp_path):
    out, run = tmp_path / "out", tmp_path / "run"
    procs = launch(out, run, processes=2, devices=2, steps=8, extra=["--die_at_step", "1", "--die_process", "1",
                                                                     "--heartbeat_s", "10", "--beta", "0"])
    assert procs[1].wait(timeout=900) == -9  # SIGKILL after its first step
    killed_at = time.monotonic()
    rc = procs[0].wait(timeout=120)
    waited = time.monotonic() - killed_at
    assert rc != 0, (out.parent / "out_0.log").read_text()[-2000:]
    assert waited < 60, waited


@pytest.mark.slow
def test_rlbolt_fit_on_two_processes_from_environment_variables(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: {tiny: {hidden_size: 32, intermediate_size: 64, head_dim: 8}}\n"
        "plan: {prompts_per_step: 4, num_generations: 4, train_micro_batch_size: 8}\n"
        "rollout: {max_new_tokens: 8}\n"
        "reward: {weights: {digits: 1.0}}\n"
        "trainer: {max_steps: 2}\n"
        "callbacks: {checkpoint_every_n_steps: 2, progress: false, throughput: false}\n")
    run, port = tmp_path / "run", free_port()
    procs = []
    for pid in range(2):
        env = {**worker_env(), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(pid), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        procs.append(subprocess.Popen([sys.executable, "-m", "rlbolt", "fit", str(config), f"--trainer.run_dir={run}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "done: 2 steps" in outputs[0] and "done:" not in outputs[1]  # the summary is process 0's
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert (run / "config.yaml").is_file() and (run / "train.log").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "saved.json"]  # saved.json: had checkpoints
