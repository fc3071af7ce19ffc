"""One writer per run directory: the OS lock, its refusal naming the holder, and its release
by the kernel when the holder is SIGKILLed (no stale lock). The holders are small Python
processes (no JAX), so these tests cost about a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbolt.utils import runlock

HOLDER = """
import sys, time
from rlbolt.utils import runlock
runlock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def start_holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_is_refused_naming_the_holder_until_it_dies(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        started = time.monotonic()
        with pytest.raises(runlock.RunDirBusy) as info:
            runlock.acquire(run_dir)
        assert time.monotonic() - started < 1.0  # refused at once, never waits
        message = str(info.value)
        assert f"PID {holder.pid}" in message and str(run_dir) in message and "\n" not in message
        assert not runlock.is_held(run_dir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # The kernel dropped the dead holder's lock: no clean-up step, the file is still there.
    assert (run_dir / runlock.LOCK_FILE).exists()
    with runlock.hold(run_dir):
        assert runlock.is_held(run_dir)
        assert f"PID {os.getpid()}" in (run_dir / runlock.LOCK_FILE).read_text()
    assert not runlock.is_held(run_dir)


def test_reentrant_in_one_process_and_released_by_the_last_release(tmp_path):
    run_dir = tmp_path / "run"
    runlock.acquire(run_dir)
    runlock.acquire(run_dir)  # e.g. the CLI holds it and Trainer.fit takes it again
    runlock.release(run_dir)
    # Still held: a second process is refused.
    probe = subprocess.run([sys.executable, "-c", "import sys; from rlbolt.utils import runlock\n"
                            "try:\n    runlock.acquire(sys.argv[1])\nexcept runlock.RunDirBusy as e:\n"
                            "    print(e); sys.exit(3)", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 3 and f"PID {os.getpid()}" in probe.stdout
    runlock.release(run_dir)
    probe = subprocess.run([sys.executable, "-c", "import sys; from rlbolt.utils import runlock; runlock.acquire(sys.argv[1])",
                            str(run_dir)], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr


def test_lock_is_not_inherited_by_child_processes(tmp_path):
    """A reward worker or sandbox forked by the trainer must not keep the run locked after the
    trainer died: POSIX record locks are per process and not inherited across fork."""
    run_dir = tmp_path / "run"
    code = ("import os, sys, time\nfrom rlbolt.utils import runlock\nrunlock.acquire(sys.argv[1])\n"
            "pid = os.fork()\nif pid == 0:\n    null = os.open(os.devnull, os.O_WRONLY)\n    os.dup2(null, 1); os.dup2(null, 2)\n"
            "    time.sleep(60)\n    os._exit(0)\n"
            "print(pid, flush=True)\nos._exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=60)
    child = int(proc.stdout.strip())
    try:
        with runlock.hold(run_dir):  # the parent is gone, its child lives on: the lock is free
            pass
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("writes", [True, False])
def test_a_fit_holds_its_run_dir_only_while_a_callback_writes_there(tmp_path, writes):
    """`Trainer.fit` locks `run_dir` for its length when one of its callbacks declares `writes_run_dir`, and
    releases it at the end; with no such callback it leaves the directory to others."""
    from toy_module import ToyModule, prompt_rows

    from rlbolt.callback import Callback
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    run_dir, seen = tmp_path / "run", []

    class Probe(Callback):
        writes_run_dir = writes

        def on_step_end(self, trainer, info):
            seen.append(runlock.is_held(run_dir))

    Trainer(BatchPlan(prompts_per_step=2, num_generations=4), max_steps=1, run_dir=run_dir,
            callbacks=[Probe()]).fit(ToyModule(), prompt_rows(8))
    assert seen == [writes] and not runlock.is_held(run_dir)
