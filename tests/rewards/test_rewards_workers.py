"""Hostile reward functions cost only their own samples; workers stay bounded; broken rewards stop a run.

The rewards live in tests/hostile_rewards.py, importable by worker processes by name.
"""

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hostile_rewards import always_raises, hostile_reward

from rlbolt.rewards import RewardFailureError, RewardRunner

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")

PENALTY = -1.0


KINDS = ["ok", "exit", "regex", "ok", "hang", "string", "nan", "ok"]
COMPLETIONS = ["a" * (i + 1) for i in range(len(KINDS))]
EXPECTED = [len(c) if kind == "ok" else PENALTY for c, kind in zip(COMPLETIONS, KINDS)]


def _children_of(parent_pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `parent_pid`, read from /proc."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == str(parent_pid) and not fields.get("State", "").startswith("Z"):
            found.append(int(status.parent.name))
    return found


def _parent_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


@pytest.mark.parametrize("steps", [pytest.param(4, id="4-steps"), pytest.param(20, id="20-steps", marks=pytest.mark.slow)])
def test_exit_gil_regex_hang_string_and_nan_cost_only_their_samples_with_bounded_workers(steps):
    samples = [{"kind": kind} for kind in KINDS]
    others = set(_children_of(os.getpid()))  # e.g. idle workers of runners that earlier tests built
    with RewardRunner(hostile_reward, timeout_s=0.5, penalty=PENALTY, max_workers=4, executor="process") as runner:
        spawner = _parent_of(int(runner.score(["x"], [{"kind": "pid"}]).rewards[0]))
        assert spawner == os.getpid()  # workers are our own children, not a fork server's
        for step in range(steps):
            started = time.monotonic()
            result = runner.score(COMPLETIONS, samples)
            # A bound, not a benchmark: the regex alone would hold a thread runner for ~10 s.
            assert time.monotonic() - started < 8.0, step
            np.testing.assert_array_equal(result.rewards, EXPECTED)
            assert result.metrics["reward/failures"] == 3.0  # exit, string, nan
            assert result.metrics["reward/timeouts"] == 2.0  # regex, hang
            assert "exit code 3" in result.errors[1] and "'hostile'" in result.errors[1]
            assert "'0.75' (str), not a number" in result.errors[5]
            assert "not a finite number" in result.errors[6]
            # Killed workers are gone, replacements bounded: never more than max_workers alive.
            assert runner.live_workers() <= 4
            assert len(set(_children_of(spawner)) - others) <= 4, step
    time.sleep(0.2)
    assert set(_children_of(spawner)) - others == set()  # close() ends every worker


def test_threads_cannot_be_killed_so_stuck_ones_are_capped_and_the_cause_is_named():
    """The thread executor abandons a stuck reward; at most max_workers stuck threads, then
    samples fail fast naming the fix, and live threads stay bounded over 20 steps."""
    kinds = ["ok", "hang", "string", "nan", "ok"]
    samples = [{"kind": kind} for kind in kinds]
    completions = ["a" * (i + 1) for i in range(len(kinds))]

    def reward_threads() -> int:  # independent of the runner's own count
        return sum(t.name.startswith("rlbolt-reward-") for t in threading.enumerate())

    before = reward_threads()
    with RewardRunner(hostile_reward, timeout_s=0.3, penalty=PENALTY, max_workers=2, executor="thread",
                      max_failed_batches=0) as runner:
        first = runner.score(completions, samples)
        np.testing.assert_array_equal(first.rewards, [1.0, PENALTY, PENALTY, PENALTY, 5.0])
        assert first.metrics["reward/timeouts"] == 1.0 and first.metrics["reward/failures"] == 2.0
        for step in range(19):
            result = runner.score(completions, samples)
            assert reward_threads() - before <= 2 * runner.max_workers, step
            assert runner.live_workers() <= 2 * runner.max_workers
        # Both slots now hold stuck threads: nothing can run, and the message says why.
        assert np.all(result.rewards == PENALTY)
        assert "threads are stuck" in result.errors[0] and "reward.executor=process" in result.errors[0]


def test_unpicklable_reward_falls_back_to_threads_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="rlbolt.rewards.runner")
    with RewardRunner(lambda completion, sample: 2.0) as runner:  # "auto", the default
        assert runner.executor == "thread"
        np.testing.assert_array_equal(runner.score(["a"], [{}]).rewards, [2.0])
    warnings = [r.getMessage() for r in caplog.records if "runs on threads" in r.getMessage()]
    assert len(warnings) == 1 and "os._exit" in warnings[0] and "module level" in warnings[0]
    with pytest.raises(TypeError, match="picklable"):
        RewardRunner(lambda completion, sample: 2.0, executor="process")
    with RewardRunner(hostile_reward) as runner:
        assert runner.executor == "process"


def test_a_reward_failing_on_every_sample_stops_after_max_failed_batches(caplog):
    caplog.set_level(logging.WARNING, logger="rlbolt.rewards.runner")
    with RewardRunner(always_raises, max_failed_batches=3, penalty=PENALTY) as runner:
        for _ in range(2):
            assert np.all(runner.score(["a", "b"], [{}, {}]).rewards == PENALTY)
        with pytest.raises(RewardFailureError, match=r"3 consecutive batches .*reward 'always_raises' raised "
                                                     r"RuntimeError: the grader is down"):
            runner.score(["a", "b"], [{}, {}])
    # One warning for the distinct failure, however many samples and steps repeat it.
    assert sum("the grader is down" in r.getMessage() for r in caplog.records) == 1
    # A batch with one success resets the count; 0 never stops.
    with RewardRunner(hostile_reward, max_failed_batches=2) as runner:
        for _ in range(4):
            runner.score(["a", "b"], [{"kind": "nan"}, {"kind": "ok" if _ % 2 else "nan"}])
    with RewardRunner(always_raises, max_failed_batches=0) as runner:
        for _ in range(4):
            assert runner.score(["a"], [{}]).metrics["reward/failures"] == 1.0



ORPHAN_MAKER = r"""
import sys, threading
sys.path[:0] = sys.argv[1:]
from hostile_rewards import hostile_reward
from rlbolt.rewards import RewardRunner
from rlbolt.rewards.sandbox import run_python_sandboxed
runner = RewardRunner(hostile_reward, executor="process", max_workers=1, timeout_s=600)
threading.Thread(target=runner.score, args=(["x"], [{"kind": "hang"}]), daemon=True).start()
print("ready", flush=True)
run_python_sandboxed("import time\ntime.sleep(600)", wall_s=600, cpu_s=600)
"""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("PPid:"))
        except (OSError, StopIteration):
            continue
        children.setdefault(ppid, []).append(int(status.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_workers_and_sandboxes_die_with_a_sigkilled_trainer():
    """A trainer killed mid-step (SIGKILL: no cleanup code runs) leaves no reward worker and no
    sandboxed program behind, even ones that sleep for ten minutes."""
    import subprocess
    import sys

    tests_dir, src = Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2] / "src"
    trainer = subprocess.Popen([sys.executable, "-c", ORPHAN_MAKER, str(tests_dir), str(src)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the worker and the sandboxed program both run
            commands = [_cmdline(pid) for pid in _descendants(trainer.pid)]
            if any(b"_reward_worker.py" in c for c in commands) and any(b'"limits"' in c for c in commands):
                break
            time.sleep(0.1)
        time.sleep(0.5)  # the sandbox's own children (namespaces, bwrap) start in a moment
        started = _descendants(trainer.pid)
        commands = [_cmdline(pid) for pid in started]
        assert any(b"_reward_worker.py" in c for c in commands) and any(b'"limits"' in c for c in commands)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if _alive(pid)] == []


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_a_terms_warm_up_runs_before_any_samples_clock_starts(executor, monkeypatch):
    from hostile_rewards import _WARM, lazily_warmed_reward, warmed_reward

    monkeypatch.setenv("RLBOLT_TEST_WARM_S", "1.5")  # the workers inherit it
    samples, texts = [{"k": i} for i in range(4)], ["x"] * 4
    # The fault: slow set-up inside the first call times out (and a killed worker's replacement
    # starts cold again), so every sample may fail.
    _WARM["done"] = False
    with RewardRunner(lazily_warmed_reward, timeout_s=0.5, executor=executor, max_workers=2) as lazy:
        first = lazy.score(texts, samples)
    assert first.metrics["reward/timeouts"] >= 1
    # The fix: the same set-up as the term's warm_up runs when a worker starts (the thread pool:
    # once, when it is made); each sample sees a warm worker and scores 1.0 within 0.5 s.
    _WARM["done"] = False
    with RewardRunner(warmed_reward, timeout_s=0.5, executor=executor, max_workers=2) as warm:
        for _ in range(2):
            result = warm.score(texts, samples)
            assert result.metrics["reward/timeouts"] == 0 and result.rewards.tolist() == [1.0] * 4


def test_task_reward_declares_its_import_as_warm_up():
    from rlbolt.rewards.task_reward import reasoning_gym_reward

    assert callable(reasoning_gym_reward.warm_up)
    from rlbolt.rewards.combine import WeightedReward
    import functools

    calls = []

    def term(completion, sample):
        return 0.0

    term.warm_up = lambda: calls.append("plain")
    partial_term = functools.partial(term)
    WeightedReward([("a", term, 1.0), ("b", partial_term, 1.0), ("c", lambda c, s: 0.0, 1.0)]).warm_up()
    assert calls == ["plain", "plain"]  # a partial's function's hook runs too; a term without one is skipped


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_a_warm_up_that_raises_is_logged_and_the_samples_still_score(executor, caplog):
    from hostile_rewards import reward_with_broken_warm_up

    caplog.set_level(logging.WARNING)
    with RewardRunner(reward_with_broken_warm_up, executor=executor, max_workers=1) as runner:
        result = runner.score(["x", "y"], [{}, {}])
        assert runner.executor == executor  # a process worker boots: no fall-back to threads
    assert result.rewards.tolist() == [0.5, 0.5] and result.metrics["reward/failures"] == 0
    if executor == "thread":  # a process worker logs in its own process
        assert any("warm_up raised" in r.getMessage() for r in caplog.records)
