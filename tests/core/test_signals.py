"""SIGINT / SIGTERM inside `Trainer.fit`, in-process (the process signals itself at a chosen
moment, so the moment is exact and nothing needs a subprocess): the step in progress completes,
the last completed step is saved, fit reports the interruption, the handlers are restored, and
a resume matches a run that never stopped. The command-line exit codes (130 / 143) are tested in
tests/cli/test_cli_faults.py, the second signal during a real fit in tests/callbacks/test_signal_resume.py
(slow); here, in a small subprocess, that a second signal taken by another thread ends the process at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.plan import BatchPlan
from rlbolt.signals import Interrupted
from rlbolt.trainer import Trainer

EXCLUDED = ("time/", "throughput/")


def plan():
    return BatchPlan(prompts_per_step=2, num_generations=4)


class Record(Callback):
    def __init__(self):
        self.metrics: dict[int, dict] = {}
        self.ended = []

    def on_step_end(self, trainer, info):
        self.metrics[info.step] = {k: v for k, v in info.metrics.items() if not k.startswith(EXCLUDED)}

    def on_fit_end(self, trainer, state):
        self.ended.append((state.step, trainer.interrupted))


class SignalAt(Callback):
    """Sends `signum` to this process in on_step_start of step `step` (0-based: during step+1)."""

    order = -100

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_step_start(self, trainer, step):
        if step == self.step:
            os.kill(os.getpid(), self.signum)


def fit(run_dir, max_steps, *extra, module=None):
    rec = Record()
    trainer = Trainer(plan(), max_steps=max_steps, seed=5, run_dir=run_dir,
                      callbacks=[rec, ModelCheckpoint(keep=None, async_save=False), *extra])
    state = trainer.fit(module or ToyModule(), prompt_rows(32))
    return trainer, state, rec


def steps_on_disk(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def interrupted_fit(run_dir, signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    trainer, state, rec = fit(run_dir, 6, SignalAt(2, signum))  # arrives while step 3 runs
    assert trainer.interrupted and trainer.stop_signal == signum
    assert state.step == 3 and sorted(rec.metrics) == [1, 2, 3]  # the running step completed
    assert rec.ended == [(3, True)]  # on_fit_end ran, told it was an interruption
    assert steps_on_disk(run_dir) == [3]  # no periodic saves: the stop saved the last step
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    return rec


def test_signal_mid_step_completes_it_and_saves_it(tmp_path):
    interrupted_fit(tmp_path / "run", signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_step_then_resume_matches_an_uninterrupted_run(tmp_path, signum):
    _, reference, ref_rec = fit(tmp_path / "reference", 6)
    run_dir = tmp_path / "run"
    rec = interrupted_fit(run_dir, signum)
    trainer, state, rec2 = fit(run_dir, 6)
    assert not trainer.interrupted and trainer.stop_signal is None and state.step == 6
    assert sorted(rec2.metrics) == [4, 5, 6]
    for step in range(1, 7):
        assert {**rec.metrics, **rec2.metrics}[step] == ref_rec.metrics[step], step
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


class SlowProducer(ToyModule):
    """Rollouts of the third step and later take long: the main thread waits for data."""

    def on_rollout(self, params, batch):
        if int(batch["prompt_index"][0]) >= 4:
            time.sleep(1.5)
        return super().on_rollout(params, batch)


class SignalWhileWaiting(Callback):
    def on_step_end(self, trainer, info):
        if info.step == 2:  # the main thread will now wait ~1.5 s for step 3's batch
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()


def test_signal_while_waiting_for_data_stops_at_once_without_a_new_step(tmp_path):
    started = time.monotonic()
    trainer, state, rec = fit(tmp_path / "run", 6, SignalWhileWaiting(), module=SlowProducer())
    assert trainer.interrupted and state.step == 2 and sorted(rec.metrics) == [1, 2]
    assert steps_on_disk(tmp_path / "run") == [2]
    # Left the wait at once: no third step; the producer's sleeping rollout is not waited for
    # beyond its own end (it stops at its next poll).
    assert time.monotonic() - started < 60


class SignalInSetup(ToyModule):
    def setup(self, trainer):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs at the next bytecode
        raise AssertionError("setup went on after the signal")


def test_signal_before_the_first_step_raises_interrupted_at_once(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    trainer = Trainer(plan(), max_steps=3, run_dir=tmp_path / "run", callbacks=[ModelCheckpoint()])
    with pytest.raises(Interrupted) as info:
        trainer.fit(SignalInSetup(), prompt_rows(8))
    assert info.value.signum == signal.SIGINT and info.value.exit_code == 130
    assert str(info.value) == "interrupted by SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_fit_in_a_thread_installs_no_handlers(tmp_path):
    seen = {}

    class Probe(Callback):
        def on_step_end(self, trainer, info):
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    worker = threading.Thread(target=lambda: Trainer(plan(), max_steps=1, callbacks=[Probe()]).fit(ToyModule(), prompt_rows(8)))
    worker.start()
    worker.join(120)
    assert seen["handler"] is before


SECOND_SIGNAL_ON_ANOTHER_THREAD = """
import signal, sys, threading, time
from rlbolt.signals import StopOnSignal

stops = []
with StopOnSignal(stops.append, announce=False) as handlers:
    handlers.defer()
    signal.raise_signal(signal.SIGTERM)  # the first: its handler runs here, on the main thread
    assert stops == [signal.SIGTERM], stops
    def second():
        time.sleep(0.3)
        print("sent", time.monotonic(), flush=True)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # taken by this thread, not the main one
    threading.Thread(target=second).start()
    time.sleep(20)  # the main thread sleeps in C: a Python handler would run only after it
print("survived", flush=True)
"""


def test_a_second_signal_taken_by_another_thread_ends_the_process_at_once():
    """The kernel hands a process's signal to any of its threads; a Python handler then runs only once
    the main thread is back in Python (after a 20 s sleep here). The first signal restores the default
    action, so the second ends the process when it arrives, killed by it (the shell's 143)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_ON_ANOTHER_THREAD], capture_output=True, text=True,
                          timeout=120)
    ended = time.monotonic()
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert "survived" not in proc.stdout
    sent = float(proc.stdout.split("sent ")[1].split()[0])
    assert ended - sent < 10.0  # the sleep had 19.7 s to go; the bound leaves room for a loaded box's exit
