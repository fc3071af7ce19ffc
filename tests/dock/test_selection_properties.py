"""Property tests of the dock's selection rules, each against a plain statement of the rule:
whole groups, n larger than what is ready, length balance, and time-outs."""

from __future__ import annotations

import threading
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbolt.producer.dock import ExperienceDock, balanced, balanced_order

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def docks(draw):
    """Groups of random sizes, a random subset of samples ready (column "r" written)."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=12))
    groups = np.repeat(np.arange(len(sizes)), sizes)
    ready = np.asarray(draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups))))
    return groups, ready


def build(groups, ready):
    dock = ExperienceDock({"s": ("r",)})
    dock.add({"x": np.arange(len(groups)), "group_ids": groups})
    if ready.any():
        dock.put({"r": np.flatnonzero(ready).astype(float)}, np.flatnonzero(ready))
    return dock


@SETTINGS
@given(docks(), st.integers(1, 30))
def test_whole_groups_take_ready_groups_in_order_until_one_does_not_fit(case, n):
    groups, ready = case
    sizes = np.bincount(groups)
    if sizes.max() > n:
        n = int(sizes.max())  # a group larger than n is an error (tested in test_store)
    dock = build(groups, ready)
    batch, got = dock.get("s", n=n, whole_groups=True, timeout=0)
    # the rule, stated plainly: walk groups in order, skip those not all ready, stop at the
    # first ready group that would overshoot n
    expected = []
    for g in range(len(sizes)):
        members = np.flatnonzero(groups == g).tolist()
        if not ready[members].all():
            continue
        if len(expected) + len(members) > n:
            break
        expected += members
    assert got.tolist() == expected
    assert len(got) <= n and ready[got].all()
    for g in set(groups[got].tolist()):
        assert (groups[got] == g).sum() == sizes[g]  # never split
    if len(got):
        np.testing.assert_array_equal(batch["x"], got)
    else:
        assert batch.num_samples == 0 and not list(batch)  # nothing taken: an empty Batch
    again = dock.get("s", n=n, whole_groups=True, timeout=0)[1]
    assert not set(again.tolist()) & set(got.tolist())  # taken once


@SETTINGS
@given(docks(), st.integers(1, 80))
def test_n_larger_than_what_is_ready_takes_every_ready_sample(case, n):
    groups, ready = case
    dock = build(groups, ready)
    _, got = dock.get("s", n=n, timeout=0)
    assert got.tolist() == np.flatnonzero(ready).tolist()[:n]


@SETTINGS
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 8), st.integers(1, 3))
def test_balanced_micro_batches_differ_by_at_most_the_longest_minus_the_shortest_unit(lengths, micro, group):
    units = len(lengths) // group
    micro_units = max(1, micro // group)
    units -= units % micro_units
    if units == 0:
        return
    lengths = np.asarray(lengths[:units * group])
    dock = ExperienceDock({"s": ("length",)})
    dock.add({"length": lengths, "group_ids": np.repeat(np.arange(units), group)})
    micro = micro_units * group
    batch, got = balanced(dock.get("s", n=len(lengths), whole_groups=True), micro, lengths="length", whole_groups=True)
    assert sorted(got.tolist()) == list(range(len(lengths)))  # a permutation: nothing lost or repeated
    np.testing.assert_array_equal(batch["length"], lengths[got])
    unit_totals = lengths.reshape(units, group).sum(axis=1)
    totals = batch["length"].reshape(-1, micro).sum(axis=1)
    assert totals.max() - totals.min() <= unit_totals.max() - unit_totals.min()
    for k in range(0, len(got), micro):  # whole groups inside every micro batch
        ids = got[k:k + micro] // group
        assert all((ids == g).sum() == group for g in set(ids.tolist()))


@SETTINGS
@given(st.lists(st.integers(0, 1000), min_size=2, max_size=24), st.integers(1, 6))
def test_balanced_order_bounds_the_spread_and_keeps_every_unit(lengths, per_bin):
    lengths = lengths[: len(lengths) - len(lengths) % per_bin] or lengths[:per_bin]
    if len(lengths) % per_bin:
        return
    bins = balanced_order(lengths, per_bin)
    assert sorted(u for b in bins for u in b) == list(range(len(lengths)))
    assert all(len(b) == per_bin for b in bins)
    totals = [sum(lengths[u] for u in b) for b in bins]
    assert max(totals) - min(totals) <= max(lengths) - min(lengths)


@settings(max_examples=8, deadline=None)
@given(st.floats(0.02, 0.08), st.booleans())
def test_time_outs(timeout, write_in_time):
    dock = ExperienceDock({"s": ("r",)})
    dock.add({"x": np.arange(4)})
    dock.put({"r": np.ones(1)}, [3])
    if write_in_time:  # the missing samples arrive well before the time-out
        timer = threading.Timer(timeout / 4, lambda: dock.put({"r": np.ones(3)}, [0, 1, 2]))
        timer.start()
    start = time.monotonic()
    _, got = dock.get("s", n=4, timeout=timeout * (20 if write_in_time else 1))
    elapsed = time.monotonic() - start
    stats = dock.stats()["s"]
    if write_in_time:
        timer.join()
        assert got.tolist() == [0, 1, 2, 3] and stats.timeouts == 0
    else:
        assert elapsed >= timeout and got.tolist() == [3] and stats.timeouts == 1
    assert stats.waits == 1
