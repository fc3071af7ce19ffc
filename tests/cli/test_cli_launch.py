"""`rlbolt launch --local N`: the environment each process gets, output prefixes, the first failure
stopping the rest, signals passed on once, and bad command lines.

The default-tier tests launch small Python programs (no JAX; well under a second each); the slow
test launches a real two-process `rlbolt fit` and checks it ran as one run.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlbolt.app.cli import main
from rlbolt.app.cli_launch import child_command, run_local

# Each process prints what it was given, one JSON line.
SHOW_ENV = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ('JAX_COORDINATOR_ADDRESS', "
            "'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'SLURM_NTASKS', 'XLA_FLAGS', 'JAX_LOCAL_DEVICE_IDS', "
            "'RLBOLT_TRANSFER_ADDRESS')}))")


def launched(argv, count, **kwargs):
    out, err = io.BytesIO(), io.BytesIO()
    code = run_local(argv, count, stdout=out, stderr=err, **kwargs)
    return code, out.getvalue().decode().splitlines(), err.getvalue().decode().splitlines()


def test_every_process_gets_its_own_index_one_address_and_no_outer_launcher_settings():
    base = {**os.environ, "SLURM_NTASKS": "8", "JAX_PROCESS_ID": "5", "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"}
    code, out, err = launched([sys.executable, "-c", SHOW_ENV], 3, port=23456, devices_per_process=2,
                              gpus_per_process=2, env=base)
    assert code == 0 and err == []
    seen = {}
    for line in out:
        prefix, _, payload = line.partition(" ")
        env = json.loads(payload)
        assert prefix == f"[{env['JAX_PROCESS_ID']}]"  # each line carries the index of the process that printed it
        seen[int(env["JAX_PROCESS_ID"])] = env
    assert sorted(seen) == [0, 1, 2]
    for env in seen.values():
        assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:23456" and env["JAX_NUM_PROCESSES"] == "3"
        assert env["SLURM_NTASKS"] is None  # an outer Slurm job's settings would make the copies join it
        # the requested device count replaces the inherited one; other flags stay
        assert env["XLA_FLAGS"].split() == ["--foo", "--xla_force_host_platform_device_count=2"]
    assert [seen[i]["JAX_LOCAL_DEVICE_IDS"] for i in range(3)] == ["0,1", "2,3", "4,5"]  # 2 GPUs each, in order
    transfer = {seen[i]["RLBOLT_TRANSFER_ADDRESS"] for i in range(3)}  # a transfer socket of its own each
    assert len(transfer) == 3 and all(a.startswith("127.0.0.1:") for a in transfer)


def test_the_first_failure_stops_the_others_and_is_named_in_one_line(tmp_path):
    # process 1 fails after 0.3 s; the others would run for 60 s and write a file when done.
    program = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); print('started', flush=True); "
               "time.sleep(0.3)\nif i == 1: print('warming up', file=sys.stderr); sys.exit('error: model.path missing')\n"
               f"time.sleep(60); open(r'{tmp_path}' + f'/done{{i}}', 'w')")
    start = time.monotonic()
    code, out, err = launched([sys.executable, "-c", program], 3, grace_s=5)
    assert time.monotonic() - start < 30  # not the 60 s the others would have run
    assert code == 1  # the failed process's own status
    assert sorted(out) == ["[0] started", "[1] started", "[2] started"]
    assert err[-1] == "rlbolt launch: process 1 of 3 exited with status 1: error: model.path missing; stopped the other 2"
    assert "[1] error: model.path missing" in err
    assert list(tmp_path.iterdir()) == []  # the others never finished


def test_the_line_names_the_exception_not_the_note_printed_under_it():
    # an exception raised in a producer thread carries a note, printed on its own line after the exception's
    program = ("e = TimeoutError('nothing from process 3 under rows/1/0/1')\n"
               "e.add_note('(raised in the producer thread rlbolt-producer-rollout; its frames are above)')\nraise e")
    code, _, err = launched([sys.executable, "-c", program], 1, grace_s=5)
    assert code == 1
    assert err[-1] == ("rlbolt launch: process 0 of 1 exited with status 1: TimeoutError: nothing from process 3 "
                       "under rows/1/0/1")


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    program = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "i = int(os.environ['JAX_PROCESS_ID']); print('up', flush=True); time.sleep(0.3)\n"
               "if i == 0: os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)")
    start = time.monotonic()
    code, _, err = launched([sys.executable, "-c", program], 2, grace_s=0.5)
    assert time.monotonic() - start < 30
    assert code == 128 + signal.SIGKILL
    assert err[-1] == "rlbolt launch: process 0 of 2 was killed by SIGKILL; stopped the other 1"


def test_the_line_names_the_last_step_the_dead_process_recorded():
    """Each process records its last completed step (`step_beacon.record_step`, as the Trainer and a rollout
    group do after every step); the launcher's line names the dead one's, not another process's."""
    program = ("import os, signal, time; from rlbolt.utils.step_beacon import record_step\n"
               "i = int(os.environ['JAX_PROCESS_ID'])\n"
               "for s in range(1, 4 + 3 * i): record_step(f'step {s}')\n"
               "if i == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(60)")
    code, _, err = launched([sys.executable, "-c", program], 2, grace_s=0.5)
    assert code == 128 + signal.SIGKILL
    assert err[-1] == "rlbolt launch: process 1 of 2 was killed by SIGKILL after step 6; stopped the other 1"


def test_a_signal_to_the_launcher_reaches_every_process_once(tmp_path):
    # each process records every SIGTERM it gets, then exits 143 like `rlbolt fit` does after saving
    program = ("import os, signal, sys, time\ni = os.environ['JAX_PROCESS_ID']\n"
               "def on(s, f):\n  open(os.path.join(sys.argv[1], 'got' + i), 'a').write('x')\n  time.sleep(0.5); os._exit(143)\n"
               "signal.signal(signal.SIGTERM, on); print('ready', flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-m", "rlbolt", "launch", "--local", "2", "--", sys.executable, "-c",
                                 program, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        while ready < 2:
            ready += launcher.stdout.readline().endswith("ready\n")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 143
    finally:
        if launcher.poll() is None:  # a failed check leaves nothing running: a second signal kills the processes
            launcher.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=30)
    assert sorted((p.name, p.read_text()) for p in tmp_path.iterdir()) == [("got0", "x"), ("got1", "x")]
    assert "rlbolt launch: process" not in launcher.stderr.read()  # stopping on request is not a failure


def test_the_process_index_is_read_from_the_config_then_the_environment_before_jax_starts():
    from rlbolt.utils.jax_env import named_process_id

    assert named_process_id(None, {}) is None
    assert named_process_id(None, {"JAX_PROCESS_ID": "3"}) == 3
    assert named_process_id(2, {"JAX_PROCESS_ID": "3"}) == 2  # the config first, as jax.distributed's start reads it
    assert named_process_id(None, {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}) == 5
    assert named_process_id(None, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # one Slurm task: one process
    assert named_process_id(True, {"JAX_PROCESS_ID": " x"}) is None  # hostile: a bool, a value that is no index


def test_rlbolt_resume_on_a_process_other_than_0_leaves_the_lock_to_process_0(tmp_path, monkeypatch):
    # `rlbolt launch --local N -- rlbolt resume D` (seen: process 0 refused, "in use by another rlbolt process"): every
    # process used to lock D before JAX started, so on one machine the first to lock refused the others
    import rlbolt.app.cli_run
    from rlbolt.config import load_config, save_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config("recipes/configs/grpo_gsm8k.yaml"), run_dir / "config.yaml")
    lock = run_dir / ".rlbolt.lock"  # runlock's file: another process's lockf on it is what a refusal sees
    hold = (f"import fcntl, os, sys; fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT); "
            "fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # process 0 of the run holds the folder
        resumed = []
        monkeypatch.setattr(rlbolt.app.cli_run, "run_config", lambda cfg, **kwargs: resumed.append(kwargs))
        monkeypatch.setenv("JAX_PROCESS_ID", "1")
        assert main(["resume", str(run_dir)]) == 0 and resumed[0]["resume"] is True
        monkeypatch.setenv("JAX_PROCESS_ID", "0")  # a second process 0, or a second run: refused at once
        assert main(["resume", str(run_dir)]) == 2 and len(resumed) == 1
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_rlbolt_commands_run_with_this_python_and_others_as_given():
    assert child_command(["--", "rlbolt", "fit", "c.yaml", "--trainer.max_steps=2"]) == [
        sys.executable, "-m", "rlbolt", "fit", "c.yaml", "--trainer.max_steps=2"]
    assert child_command(["python", "train.py"]) == ["python", "train.py"]


@pytest.mark.parametrize("argv, message", [
    (["launch", "--local", "2"], "no command to launch; give it after `--`"),
    (["launch", "--local", "2", "--", "rlbolt", "demo"], "`rlbolt demo` does not run over several processes"),
    (["launch", "--local", "2", "--", "rlbolt", "launch", "--local", "2"], "`rlbolt launch` does not run over"),
    (["launch", "--local", "2", "--port", "70000", "--", "rlbolt", "fit", "c.yaml"], "--port 70000 is not a TCP port"),
    (["launch", "--local", "2", "--grace-s", "-1", "--", "rlbolt", "fit", "c.yaml"], "--grace-s -1 must be >= 0"),
])
def test_bad_command_lines_end_with_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlbolt launch: error: ") and message in err


@pytest.mark.parametrize("count", ["0", "-1", "two"])
def test_a_process_count_below_one_is_refused_by_the_parser(count, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--local", count, "--", "rlbolt", "fit", "c.yaml"])
    assert exit_info.value.code == 2 and "--local" in capsys.readouterr().err


@pytest.mark.slow
def test_rlbolt_fit_launched_on_two_processes_is_one_run(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: {tiny: {hidden_size: 32, intermediate_size: 64, head_dim: 8}}\n"
        "plan: {prompts_per_step: 4, num_generations: 4, train_micro_batch_size: 8}\n"
        "rollout: {max_new_tokens: 8}\nreward: {weights: {digits: 1.0}}\ntrainer: {max_steps: 2}\n"
        "callbacks: {progress: false, throughput: false}\n")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    proc = subprocess.run([sys.executable, "-m", "rlbolt", "launch", "--local", "2", "--devices-per-process", "2", "--",
                           "rlbolt", "fit", str(config), f"--trainer.run_dir={run}"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[0] done: 2 steps" in proc.stdout and "[1] done" not in proc.stdout  # the summary is process 0's
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]  # one run: written once, by process 0
    # one mesh over both processes' devices: 2 processes x 2 CPU devices
    assert "mesh: data=1 fsdp=4 expert=1 tp=1 (4 devices, 2 processes)" in (run / "train.log").read_text()
