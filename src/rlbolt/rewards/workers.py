"""Reward workers for `RewardRunner`: worker processes (the default) or daemon threads.

Both kinds share one small interface so the runner's scheduler is written once:
`start_worker()` (returns at once; a process worker is `ready` only after it has loaded the
reward), `worker.submit(index, completion, sample)`, `poll(workers, timeout_s)` (events
`(worker, kind, payload)`: "ready", "boot_error" with the text, "result" with `(index, ok,
scores or error text)`, "died" with the text), `discard` (give up on a stuck or dead worker),
`stop`, and `live()` (how many threads or processes exist).

A process worker (`_reward_worker.py`) that is stuck, or that dies (a reward calling
`os._exit`, a segfault in a native extension), is killed and reaped, and a fresh one takes its
place: the pool never holds more than `max_workers` processes. Workers are plain subprocesses
(fork + exec, safe from a process running JAX's threads) talking over a socket; unlike
`multiprocessing`, they never re-import the trainer's `__main__`. They die with the trainer,
even when it is SIGKILLed (PR_SET_PDEATHSIG on Linux).

A thread cannot be killed: a stuck thread worker is abandoned (a daemon thread, so it never
blocks interpreter exit; whatever it returns later is ignored). At most `max_stuck` abandoned
threads are tolerated; beyond that no new thread starts and samples fail fast with a message
that says to use processes. A thread also cannot protect the run from a reward that calls
`os._exit` (the whole process ends) or holds the GIL in C code (the whole process freezes).
"""

from __future__ import annotations

import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from rlbolt.rewards._reward_worker import describe as describe_exception
from rlbolt.rewards.combine import WeightedReward

__all__ = ["ProcessPool", "RewardWorkerError", "ThreadPool", "describe_exception"]


class RewardWorkerError(RuntimeError):
    """A reward worker process could not start or could not load the reward function."""


def _score(reward: WeightedReward, completion: str, sample: Any) -> tuple[bool, Any]:
    try:
        return True, reward.raw_scores(completion, sample)
    except BaseException as error:  # noqa: BLE001 - a reward's sys.exit() must not end the worker silently
        return False, describe_exception(error)


class _ThreadWorker:
    ready = True

    def __init__(self, reward: WeightedReward, outbox: queue.SimpleQueue, number: int):
        self._reward, self._outbox = reward, outbox
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        self.thread = threading.Thread(target=self._loop, name=f"rlbolt-reward-{number}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            task = self._inbox.get()
            if task is None:
                return
            index, completion, sample = task
            self._outbox.put((self, "result", (index, *_score(self._reward, completion, sample))))
            if self.abandoned:
                return

    def submit(self, index: int, completion: str, sample: Any) -> None:
        self._inbox.put((index, completion, sample))

    def stop(self) -> None:
        self._inbox.put(None)


class ThreadPool:
    """Daemon-thread reward workers sharing one result queue; abandoned threads are capped.

    Args:
        reward: the reward to run.
        max_stuck: how many abandoned (stuck) threads may exist before no new thread starts.
    """

    kind = "thread"

    def __init__(self, reward: WeightedReward, max_stuck: int):
        reward.warm_up()  # once, here: a term's slow first-call work outside every sample's time-out
        self._reward = reward
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._count = 0
        self._max_stuck = max_stuck
        self._abandoned: list[_ThreadWorker] = []
        self._running: list[_ThreadWorker] = []

    def start_worker(self) -> _ThreadWorker | None:
        """A new thread, or None once `max_stuck` abandoned threads are still running."""
        if self.stuck() >= self._max_stuck:
            return None
        self._count += 1
        worker = _ThreadWorker(self._reward, self._outbox, self._count)
        self._running.append(worker)
        return worker

    def poll(self, workers: list, timeout_s: float) -> list[tuple]:
        del workers  # every thread reports through the shared queue
        try:
            first = self._outbox.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return []
        events = [first]
        while True:
            try:
                events.append(self._outbox.get_nowait())
            except queue.Empty:
                return events

    def discard(self, worker: _ThreadWorker) -> None:
        worker.abandoned = True
        worker.stop()  # lets it exit if it ever returns
        self._running.remove(worker)
        self._abandoned = [w for w in self._abandoned if w.thread.is_alive()] + [worker]

    def stop(self, worker: _ThreadWorker) -> None:
        worker.stop()
        self._running.remove(worker)

    def stuck(self) -> int:
        """How many abandoned threads are still running a reward."""
        return sum(w.thread.is_alive() for w in self._abandoned)

    def live(self) -> int:
        """Threads of this pool that are alive (working, idle or stuck)."""
        return self.stuck() + sum(w.thread.is_alive() for w in self._running)

    def no_worker_reason(self) -> str:
        return (f"no reward thread is free: {self.stuck()} threads are stuck in a reward that never "
                "returned (threads cannot be killed); use reward.executor=process")


_WORKER_SCRIPT = Path(__file__).with_name("_reward_worker.py")


class _ProcessWorker:
    def __init__(self, reward_bytes: bytes, boot_timeout_s: float):
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", str(_WORKER_SCRIPT), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True,
            )
        finally:
            theirs.close()
        self.connection = Connection(ours.detach())
        self.connection.send((list(sys.path), reward_bytes))
        self.ready = False
        self.boot_deadline = time.monotonic() + boot_timeout_s

    def submit(self, index: int, completion: str, sample: Any) -> None:
        self.connection.send((index, completion, sample))

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.connection.close()

    def stop(self) -> None:
        try:
            self.connection.send(None)
            self.process.wait(timeout=1.0)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.connection.close()


class ProcessPool:
    """Reward worker processes, one socket each; stuck or crashed ones are killed and replaced.

    Args:
        reward: the reward to run; must pickle (module-level functions, `functools.partial`
            of them, `WeightedReward` of those) and import in a fresh interpreter.
        boot_timeout_s: how long a new worker may take to import and load the reward.

    Raises:
        TypeError: the reward does not pickle.
    """

    kind = "process"

    def __init__(self, reward: WeightedReward, boot_timeout_s: float = 120.0):
        try:
            self._reward_bytes = pickle.dumps(reward)
        except Exception as error:
            raise TypeError(
                f"RewardRunner(executor='process') needs a picklable reward, but {reward!r} is not "
                f"({error}); use module-level functions or functools.partial of them, or "
                "executor='thread'"
            ) from error
        self.boot_timeout_s = boot_timeout_s
        self._running: list[_ProcessWorker] = []

    def start_worker(self) -> _ProcessWorker:
        """Starts a worker; it reports "ready" (or "boot_error") through `poll`."""
        worker = _ProcessWorker(self._reward_bytes, self.boot_timeout_s)
        self._running.append(worker)
        return worker

    def poll(self, workers: list, timeout_s: float) -> list[tuple]:
        by_connection = {worker.connection: worker for worker in workers}
        events = []
        for connection in wait(list(by_connection), timeout=max(timeout_s, 0.0)):
            worker = by_connection[connection]
            try:
                message = connection.recv()
            except (EOFError, OSError):
                events.append((worker, "died", f"the reward worker process died (exit code {worker.exit_code()})"))
                continue
            if worker.ready:
                events.append((worker, "result", message))
            elif message[0] == "ready":
                worker.ready = True
                events.append((worker, "ready", None))
            else:
                events.append((worker, "boot_error", message[1]))
        return events

    def discard(self, worker: _ProcessWorker) -> None:
        worker.kill()
        self._running.remove(worker)

    def stop(self, worker: _ProcessWorker) -> None:
        worker.stop()
        self._running.remove(worker)

    def stuck(self) -> int:
        return 0  # stuck processes are killed

    def live(self) -> int:
        """Worker processes of this pool that are alive."""
        return sum(w.process.poll() is None for w in self._running)

    def no_worker_reason(self) -> str:
        return "no reward worker process could be started"
