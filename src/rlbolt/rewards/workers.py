"""Reward workers for `RewardRunner`: daemon threads or spawned processes, one task at a time.

Both kinds share one small interface so the runner's scheduler is written once:
`submit(index, completion, sample)`, `discard()` (give up on a stuck worker) and `stop()`;
finished tasks arrive through the pool's `poll(busy, timeout_s)` as
`(worker, index, ok, payload)` with `payload` the raw scores (ok) or the error text.

Threads cannot be killed, so a stuck thread worker is *abandoned*: it is a daemon thread (it
never blocks interpreter exit), whatever it eventually returns is ignored, and a fresh worker
takes its place. A stuck process worker is killed (SIGKILL). Processes start with "spawn" or
"forkserver", never "fork": forking a process that runs JAX's threads can deadlock the child.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import queue
import threading
import traceback
from typing import Any

from rlbolt.rewards.combine import WeightedReward

__all__ = ["ProcessPool", "ThreadPool", "describe_exception"]


def describe_exception(error: BaseException) -> str:
    """`Type: message` followed by the traceback, for one log line per distinct failure."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()


class _ThreadWorker:
    def __init__(self, reward: WeightedReward, outbox: queue.SimpleQueue, number: int):
        self._reward, self._outbox = reward, outbox
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        self.dead = False
        self.thread = threading.Thread(target=self._loop, name=f"rlbolt-reward-{number}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            task = self._inbox.get()
            if task is None:
                return
            index, completion, sample = task
            try:
                result = (True, self._reward.raw_scores(completion, sample))
            except BaseException as error:  # a reward's sys.exit() must not end the worker silently
                result = (False, describe_exception(error))
            self._outbox.put((self, index, *result))
            if self.abandoned:
                return

    def submit(self, index: int, completion: str, sample: Any) -> None:
        self._inbox.put((index, completion, sample))

    def discard(self) -> None:
        self.abandoned = True
        self._inbox.put(None)  # lets it exit if it ever returns

    def stop(self) -> None:
        self._inbox.put(None)


class ThreadPool:
    """Daemon-thread reward workers sharing one result queue."""

    def __init__(self, reward: WeightedReward):
        self._reward = reward
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._count = 0
        self.abandoned: list[_ThreadWorker] = []

    def start_worker(self) -> _ThreadWorker:
        self._count += 1
        return _ThreadWorker(self._reward, self._outbox, self._count)

    def poll(self, busy: list, timeout_s: float) -> list[tuple]:
        del busy  # every thread reports through the shared queue
        try:
            first = self._outbox.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return []
        done = [first]
        while True:
            try:
                done.append(self._outbox.get_nowait())
            except queue.Empty:
                return done

    def discard(self, worker: _ThreadWorker) -> None:
        worker.discard()
        self.abandoned = [w for w in self.abandoned if w.thread.is_alive()] + [worker]

    def still_stuck(self) -> int:
        """How many abandoned threads are still running a reward."""
        return sum(w.thread.is_alive() for w in self.abandoned)


def _process_worker_main(connection, reward_bytes: bytes) -> None:
    try:
        reward = pickle.loads(reward_bytes)
    except BaseException as error:
        connection.send(("boot_error", describe_exception(error)))
        return
    connection.send(("ready", None))
    while True:
        try:
            task = connection.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, completion, sample = task
        try:
            connection.send((index, True, reward.raw_scores(completion, sample)))
        except BaseException as error:
            connection.send((index, False, describe_exception(error)))


class _ProcessWorker:
    def __init__(self, context, reward_bytes: bytes, boot_timeout_s: float):
        self.connection, child_end = context.Pipe()
        self.process = context.Process(
            target=_process_worker_main, args=(child_end, reward_bytes), daemon=True
        )
        self.process.start()
        child_end.close()
        self.dead = False
        # Wait for the handshake so a slow start (imports) is never charged to a task's time-out.
        if not self.connection.poll(boot_timeout_s):
            self.discard()
            raise RuntimeError(
                f"RewardRunner(executor='process'): a worker did not start within {boot_timeout_s} s"
            )
        try:
            kind, detail = self.connection.recv()
        except (EOFError, OSError):
            kind, detail = "boot_error", f"the worker exited with code {self.process.exitcode}"
        if kind != "ready":
            self.discard()
            raise RuntimeError(
                "RewardRunner(executor='process'): the worker could not load the reward function "
                "(define rewards at module level in an importable module, or use "
                f"executor='thread'):\n{detail}"
            )

    def submit(self, index: int, completion: str, sample: Any) -> None:
        self.connection.send((index, completion, sample))

    def discard(self) -> None:
        self.dead = True
        self.process.kill()
        self.process.join(timeout=5.0)
        self.connection.close()

    def stop(self) -> None:
        try:
            self.connection.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.connection.close()


class ProcessPool:
    """Spawned reward worker processes, one pipe each; stuck or crashed ones are killed."""

    def __init__(self, reward: WeightedReward, start_method: str, boot_timeout_s: float = 120.0):
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"RewardRunner: mp_context={start_method!r} is not allowed; use 'spawn' or "
                "'forkserver' (forking a process with JAX threads can deadlock the child)"
            )
        try:
            self._reward_bytes = pickle.dumps(reward)
        except Exception as error:
            raise TypeError(
                f"RewardRunner(executor='process') needs a picklable reward, but {reward!r} is not "
                f"({error}); use module-level functions or functools.partial of them, or "
                "executor='thread'"
            ) from error
        self._context = multiprocessing.get_context(start_method)
        self._boot_timeout_s = boot_timeout_s
        self.abandoned: list = []

    def start_worker(self) -> _ProcessWorker:
        return _ProcessWorker(self._context, self._reward_bytes, self._boot_timeout_s)

    def poll(self, busy: list, timeout_s: float) -> list[tuple]:
        by_connection = {worker.connection: worker for worker, _ in busy}
        ready = multiprocessing.connection.wait(list(by_connection), timeout=max(timeout_s, 0.0))
        done = []
        for connection in ready:
            worker = by_connection[connection]
            index = dict(busy)[worker]
            try:
                message = connection.recv()
            except (EOFError, OSError):
                worker.dead = True
                worker.process.join(timeout=5.0)
                done.append((worker, index, False, f"reward worker process died (exit code "
                                                   f"{worker.process.exitcode})"))
                continue
            done.append((worker, *message))
        return done

    def discard(self, worker: _ProcessWorker) -> None:
        worker.discard()

    def still_stuck(self) -> int:
        return 0
