"""ExperienceDock: what a get takes, when it waits, what it refuses, and that its locks are narrow.

The tests that take `make_dock` run twice: on the dock, and through a RemoteDock on a DockServer
(the same calls, results and error lines across processes); those that look at the locks and
the store inside run on the dock only."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rlbolt.producer.dock import DockClosed, DockError, ExperienceDock, balanced

STAGES = {"score": ("text",), "train": ("text", "score")}


def dock_with(n=8, group=2, *, make=ExperienceDock, **kw):
    dock = make(STAGES, **kw)
    idx = dock.add({"text": np.arange(n) * 10, "group_ids": np.repeat(np.arange(n // group), group)}, key="step0")
    return dock, idx


def test_a_stage_takes_only_ready_samples_once_and_in_order(make_dock):
    dock, idx = dock_with(make=make_dock)
    assert idx.tolist() == list(range(8))
    batch, got = dock.get("train", n=4, timeout=0)  # nothing scored yet
    assert len(got) == 0 and batch.num_samples == 0
    dock.put({"score": np.array([0.5, 0.25, 0.125])}, [5, 1, 6])
    batch, got = dock.get("train", n=2, timeout=0)
    assert got.tolist() == [1, 5]  # the lowest ready indices, in index order
    np.testing.assert_array_equal(batch["text"], [10, 50])
    np.testing.assert_array_equal(batch["score"], [0.25, 0.5])  # rows follow their samples, not put order
    batch, got = dock.get("train", n=5, timeout=0)
    assert got.tolist() == [6]  # n larger than what is ready: what is ready
    assert dock.get("train", n=5, timeout=0)[1].tolist() == []  # taken samples never come back
    batch, got = dock.get("score", n=3)
    assert got.tolist() == [0, 1, 2] and sorted(batch) == ["group_ids", "text"]


def test_whole_groups_are_never_split(make_dock):
    dock, _ = dock_with(9, group=3, make=make_dock)
    dock.put({"score": np.ones(4)}, [0, 1, 2, 3])  # group 0 complete, group 1 only partly
    batch, got = dock.get("train", n=9, whole_groups=True, timeout=0)
    assert got.tolist() == [0, 1, 2]
    dock.put({"score": np.ones(5)}, [4, 5, 6, 7, 8])
    _, got = dock.get("train", n=5, whole_groups=True, timeout=0)
    assert got.tolist() == [3, 4, 5]  # the next group (6, 7, 8) would overshoot n=5
    with pytest.raises(DockError, match="group of 3 samples does not fit n=2"):
        dock.get("train", n=2, whole_groups=True)


def test_blocking_get_waits_for_n_and_one_batch_returns_at_the_end_of_its_batch(make_dock):
    dock, _ = dock_with(6, make=make_dock)
    dock.add({"text": np.arange(4)}, key="step1")
    got = {}

    def consumer():
        got["first"] = dock.get("train", n=4)[1].tolist()
        got["second"] = dock.get("train", n=4, one_batch=True)[1].tolist()

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.1)
    assert "first" not in got  # waiting: nothing scored
    dock.put({"score": np.ones(3)}, [0, 1, 2])
    time.sleep(0.1)
    assert "first" not in got  # 3 of 4
    dock.put({"score": np.ones(3)}, [3, 4, 5])
    time.sleep(0.1)
    thread.join(2)
    assert got["first"] == [0, 1, 2, 3]
    # step0's last two samples were ready: one_batch returned them, short of n, without taking
    # (or waiting for) step1's samples
    assert got["second"] == [4, 5] and dock.stats()["train"].waits == 1


def test_timeout_returns_what_is_ready_and_counts_it(make_dock):
    dock, _ = dock_with(4, make=make_dock)
    dock.put({"score": np.ones(1)}, [2])
    start = time.monotonic()
    _, got = dock.get("train", n=3, timeout=0.2)
    assert time.monotonic() - start >= 0.2
    assert got.tolist() == [2]
    stats = dock.stats()["train"]
    assert (stats.timeouts, stats.waits, stats.samples) == (1, 1, 1) and stats.wait_s >= 0.2


def test_partial_false_takes_nothing_until_the_whole_request_is_ready(make_dock):
    dock, _ = dock_with(4, make=make_dock)
    dock.put({"score": np.ones(3)}, [0, 1, 2])
    taken = dock.get("train", n=4, timeout=0.05, partial=False)
    assert taken.timed_out and taken.indices.tolist() == []  # 3 of 4: nothing taken
    assert dock.get("train", n=4, timeout=0, partial=False).indices.tolist() == []
    dock.put({"score": np.ones(1)}, [3])
    assert dock.get("train", n=4, timeout=1, partial=False).indices.tolist() == [0, 1, 2, 3]


def test_finish_ends_waiting_and_close_raises(make_dock):
    dock, _ = dock_with(2, make=make_dock)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", dock.get("score", n=5)[1].tolist()))
    thread.start()
    time.sleep(0.05)
    assert "r" not in out  # 2 of 5: waiting for more samples
    dock.finish()
    thread.join(2)
    assert out["r"] == [0, 1]
    with pytest.raises(DockError, match="add after finish"):
        dock.add({"text": np.arange(1)})
    errors = []
    blocked = threading.Thread(target=lambda: errors.append(_raises(lambda: dock.get("train", n=1))))
    blocked.start()
    time.sleep(0.05)
    dock.close()
    blocked.join(2)
    assert errors == [DockClosed]
    with pytest.raises(DockClosed, match="closed"):
        dock.put({"score": np.ones(1)}, [0])


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc)
    return None


def test_errors_name_the_problem(make_dock):
    dock, _ = dock_with(4, make=make_dock)
    with pytest.raises(DockError, match=r"unknown stage 'rollout'; stages: \['score', 'train'\]"):
        dock.get("rollout", n=1)
    with pytest.raises(DockError, match=r"sample\(s\) \[4, 99\] do not exist"):
        dock.put({"score": np.ones(2)}, [4, 99])
    dock.put({"score": np.ones(2)}, [0, 1])
    with pytest.raises(DockError, match=r"column 'score' of sample\(s\) \[1\] is already written \(a double write\)"):
        dock.put({"score": np.ones(2)}, [1, 2])
    assert dock.get("train", n=4, timeout=0)[1].tolist() == [0, 1]  # the refused put wrote nothing
    with pytest.raises(DockError, match="indices repeat"):
        dock.put({"score": np.ones(2)}, [3, 3])
    with pytest.raises(DockError, match="3 rows for 2 indices"):
        dock.put({"score": np.ones(3)}, [2, 3])
    with pytest.raises(DockError, match="is a scalar"):
        dock.put({"score": 1.0}, [2])
    with pytest.raises(DockError, match="n=0 must be a positive integer"):
        dock.get("train", n=0)
    strict = make_dock(STAGES, columns=("text", "score"))
    with pytest.raises(DockError, match=r"add: unknown column\(s\) \['txet'\]"):
        strict.add({"txet": np.arange(2)})
    assert len(strict) == 0  # nothing half-added


def test_samples_are_forgotten_once_every_stage_is_done_and_then_refuse_writes():
    dock, _ = dock_with(4)
    dock.put({"score": np.ones(4)}, [0, 1, 2, 3])
    dock.get("score", n=4)
    dock.discard([3])  # dropped before training: the train stage will never see it
    batch, got = dock.get("train", n=4, one_batch=True)  # 3 remain: the batch's end
    assert got.tolist() == [0, 1, 2]
    assert len(dock) == 0
    assert all(chunk is None for col in dock._rows.columns.values() for chunk in col.chunks)  # memory released
    with pytest.raises(DockError, match="do not exist"):
        dock.put({"other": np.ones(1)}, [0])


def test_balance_orders_micro_batches_by_length(make_dock):
    dock = make_dock({"train": ("length",)})
    lengths = np.array([9, 8, 1, 1, 2, 2, 1, 0])  # in this order the micro batches hold 19 and 5
    dock.add({"length": lengths})
    batch, got = balanced(dock.get("train", n=8), 4, lengths="length")
    assert sorted(got.tolist()) == list(range(8))
    np.testing.assert_array_equal(batch["length"], lengths[got])  # rows moved with their indices
    totals = sorted(int(np.sum(batch["length"][k:k + 4])) for k in (0, 4))
    assert totals == [12, 12]  # the optimum, e.g. {9, 2, 1, 0} and {8, 2, 1, 1}
    with pytest.raises(DockError, match=r"balanced: the lengths column 'completion_mask' is not among"):
        balanced((batch, got), 4)
    with pytest.raises(DockError, match=r"balanced: micro=0 must be a positive micro batch size"):
        balanced((batch, got), 0, lengths="length")


def test_writers_of_different_columns_never_wait_for_each_other():
    dock = ExperienceDock({"a_stage": ("a",), "b_stage": ("b",)})
    dock.add({"x": np.arange(4)})
    dock.put({"a": np.ones(1)}, [0])
    column_a = dock._rows.columns["a"]
    column_a.lock.acquire()  # a writer of column "a" is mid-write
    try:
        done = threading.Event()
        thread = threading.Thread(target=lambda: (dock.put({"b": np.ones(4)}, [0, 1, 2, 3]), done.set()))
        thread.start()
        assert done.wait(2), "a write of column b waited for the writer of column a"
        assert dock.get("b_stage", n=4, timeout=2)[1].tolist() == [0, 1, 2, 3]
        blocked = threading.Thread(target=lambda: dock.put({"a": np.ones(1)}, [1]), daemon=True)
        blocked.start()
        time.sleep(0.05)
        assert blocked.is_alive()  # the same column does serialise (briefly, for dict updates)
    finally:
        column_a.lock.release()
    blocked.join(2)
    assert dock.get("a_stage", n=2, timeout=2)[1].tolist() == [0, 1]


def test_copying_happens_outside_the_stage_lock():
    dock = ExperienceDock({"train": ("x",)})
    dock.add({"x": np.arange(8)})
    inside, release = threading.Event(), threading.Event()
    real_gather = dock._rows.gather

    def slow_gather(chosen, names):
        if 0 in chosen:
            inside.set()
            release.wait(5)
        return real_gather(chosen, names)

    dock._rows.gather = slow_gather
    slow = threading.Thread(target=lambda: dock.get("train", n=4))
    slow.start()
    assert inside.wait(2)
    _, got = dock.get("train", n=4, timeout=2)  # same stage, while the first call still copies
    assert got.tolist() == [4, 5, 6, 7]
    release.set()
    slow.join(2)


def test_samples_added_for_some_stages_only_reach_those_and_are_then_forgotten(make_dock):
    dock, idx = dock_with(4, make=make_dock)
    # Rows entering mid-pipeline (e.g. another process's share, already scored): train only.
    late = dock.add({"text": np.array([7, 8]), "score": np.array([0.7, 0.8])}, key="step0", stages=["train"])
    assert late.tolist() == [4, 5]
    _, got = dock.get("score", n=8, timeout=0)
    assert got.tolist() == [0, 1, 2, 3]  # "score" never sees them
    batch, got = dock.get("train", n=8, timeout=0)
    assert got.tolist() == [4, 5] and batch["score"].tolist() == [0.7, 0.8]
    dock.discard(idx)  # the unscored originals leave train's queue: every stage is done with everything
    assert len(dock) == 0
    with pytest.raises(DockError, match="unknown stage 'rollout'"):
        dock.add({"text": np.arange(2)}, stages=["rollout"])
    with pytest.raises(DockError, match="stages is empty"):
        dock.add({"text": np.arange(2)}, stages=[])
    assert len(dock) == 0  # a refused add leaves nothing behind
