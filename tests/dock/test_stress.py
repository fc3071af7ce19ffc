"""Many threads on one dock: producers add batches of groups, three consumer stages take at
random sizes (blocking, non-blocking, with time-outs, one batch or any) and write columns or
drop groups. Afterwards every sample reached every stage exactly once (dropped groups: none
after the drop), never before its input columns were written, with groups whole where asked.

The default tier runs it for 3 s; the slow tier for 10 s with more threads, and for 5 s through
a RemoteDock (every thread's calls on one Flight client, over loopback to a DockServer)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import defaultdict

import numpy as np
import pytest

from rlbolt.producer.dock import ExperienceDock

# a -> (stage "b" writes b = 2a + 1) -> (stage "c", whole groups, writes c = b * 3 or drops
# the group) -> (stage "d" takes c)
STAGES = {"b": ("a",), "c": ("a", "b"), "d": ("a", "b", "c")}
ALWAYS_WHOLE = ("c", "d")
MAX_IN_FLIGHT = 400


class Log:
    def __init__(self):
        self.lock = threading.Lock()
        self.clock = itertools.count()  # next() is one atomic step: a global order of events
        self.taken = defaultdict(list)  # stage -> [(indices, event number after the get)]
        self.write_started = {}  # (column, index) -> event number before the put
        self.groups = {}  # index -> group id
        self.dropped = set()
        self.errors = []


def run_stress(seconds: float, producers: int, consumers: int, seed: int, make=ExperienceDock) -> Log:
    dock = make(STAGES)
    log = Log()
    stop_adding = threading.Event()
    next_group = itertools.count()

    def producer(k):
        rng = random.Random(seed * 100 + k)
        while not stop_adding.is_set():
            if len(dock) > MAX_IN_FLIGHT:  # like the pipeline, whose weights gate how far it runs ahead
                time.sleep(0.001)
                continue
            sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 5))]
            gids = [next(next_group) for _ in sizes]
            groups = np.repeat(gids, sizes)
            a = rng.random() * np.ones(len(groups))
            gsize = np.repeat(sizes, sizes)  # each sample carries its group's size, for the checks
            idx = dock.add({"group_ids": groups, "a": a, "gsize": gsize},
                           key=None if rng.random() < 0.7 else ("shared", k))
            with log.lock:
                log.groups.update(zip(idx.tolist(), groups.tolist()))
            time.sleep(rng.random() * 0.003)

    def consumer(stage, k):
        rng = random.Random(seed * 1000 + hash(stage) % 97 + k)
        while True:
            finishing = dock_finished.is_set()
            # c and d always take whole groups; b mixes (a group is then what b has not taken)
            whole = stage != "b" or rng.random() < 0.3
            n = rng.randint(4 if whole else 1, 9)
            mode = rng.choice(["block", "timeout", "nowait"]) if not finishing else "block"
            batch, idx = dock.get(stage, n=n, whole_groups=whole, one_batch=rng.random() < 0.3,
                                  timeout={"block": None, "nowait": 0, "timeout": rng.random() * 0.01}[mode])
            after = next(log.clock)
            if not len(idx):
                if finishing and mode == "block":
                    return
                continue
            check(stage, batch, idx, whole, after)
            time.sleep(rng.random() * 0.002)
            if stage == "b":
                write(dock, "b", 2 * batch["a"] + 1, idx)
            elif stage == "c":
                groups = batch["group_ids"]
                drop = np.isin(groups, [g for g in set(groups.tolist()) if rng.random() < 0.2])
                if drop.any():
                    with log.lock:
                        log.dropped.update(idx[drop].tolist())
                    dock.discard(idx[drop])
                if (~drop).any():
                    write(dock, "c", 3 * batch["b"][~drop], idx[~drop])

    def write(dock, column, values, idx):
        before = next(log.clock)
        with log.lock:
            for i in idx.tolist():
                log.write_started[(column, i)] = before
        dock.put({column: values}, idx)

    def check(stage, batch, idx, whole, after):
        try:
            np.testing.assert_array_equal(batch["b"] if stage != "b" else 2 * batch["a"] + 1, 2 * batch["a"] + 1)
            if stage == "d":
                np.testing.assert_array_equal(batch["c"], 3 * batch["b"])
            with log.lock:
                for col in STAGES[stage][1:]:  # "a" is written by add, with the sample itself
                    for i in idx.tolist():
                        assert log.write_started[(col, i)] < after, f"{stage} got sample {i} before {col} was written"
                if stage in ALWAYS_WHOLE:
                    gids, sizes = batch["group_ids"].tolist(), batch["gsize"].tolist()
                    for g, size in set(zip(gids, sizes)):
                        assert gids.count(g) == size, f"stage {stage} split group {g}"
                log.taken[stage].append(idx.tolist())
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            log.errors.append(exc)

    dock_finished = threading.Event()
    threads = [threading.Thread(target=producer, args=(k,)) for k in range(producers)]
    threads += [threading.Thread(target=consumer, args=(s, k)) for s in STAGES for k in range(consumers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop_adding.set()
    for t in threads[:producers]:
        t.join(10)
    dock.finish()
    dock_finished.set()
    t0 = time.monotonic()
    for t in threads[producers:]:
        t.join(30)
    print(f"{len(log.groups)} samples; drained in {time.monotonic() - t0:.2f} s")
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert len(dock) == 0, f"{len(dock)} samples never left the dock"
    return log


def verify(log: Log) -> None:
    assert not log.errors, log.errors[:3]
    everyone = set(log.groups)
    assert len(everyone) > 100
    for stage in STAGES:
        flat = [i for idx in log.taken[stage] for i in idx]
        assert len(flat) == len(set(flat)), f"stage {stage} got a sample twice"
        expected = everyone - log.dropped if stage == "d" else everyone
        assert set(flat) == expected, f"stage {stage}: {len(expected ^ set(flat))} samples missing or extra"
    assert log.dropped and not log.dropped & set(i for idx in log.taken["d"] for i in idx)


def test_stress_short():
    verify(run_stress(seconds=3.0, producers=2, consumers=2, seed=0))


@pytest.mark.slow
def test_stress_ten_seconds():
    verify(run_stress(seconds=10.0, producers=3, consumers=3, seed=1))


@pytest.mark.slow
def test_stress_through_a_remote_dock():
    from rlbolt.producer.dock.flight import DockServer, RemoteDock

    made = []

    def make(stages):
        made.append(DockServer(ExperienceDock(stages)))
        made.append(RemoteDock(made[0].location, process="stress"))
        return made[-1]

    try:
        verify(run_stress(seconds=5.0, producers=2, consumers=2, seed=2, make=make))
    finally:
        made[1].disconnect()
        made[0].shutdown()
