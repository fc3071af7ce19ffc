"""The rollout rows between process groups over Arrow Flight (`rlbolt.distributed.group_rows.FlightRows`).

Without `jax.distributed`: the coordination service's key-value store is a dict here (`_Link`), the
training side serves on loopback, and the rollout side writes from this process (threads) or, to be
killed mid-put, from a child process. The 4-process runs through it: test_process_groups.py,
test_async_groups.py, test_group_faults.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from rlbolt.distributed.group_rows import FlightRows, advertised_host, arrow_columns
from rlbolt.producer.dock import DockError
from rlbolt.producer.dock.flight import RemoteDock

LOOPBACK = "127.0.0.1:1"  # the coordinator's address: the server advertises loopback
SLACK_S = 3.0  # the dock's watchdog tick and thread scheduling on a loaded 2-core host (test_flight.py's bound)


class _Link:
    """The GroupLink's put/take over a dict (every key read once, as the key-value store's)."""

    def __init__(self):
        self.values: dict = {}

    def put(self, key, obj):
        assert key not in self.values, key
        self.values[key] = obj

    def take(self, key, stop=lambda: False, sender=None):
        return self.values.pop(key)


def _rows(step: int, n: int = 4) -> dict:
    rng = np.random.default_rng(step)
    return {"sample_keys": rng.integers(0, 2**32, (n, 2), dtype=np.uint32),
            "completion_ids": rng.integers(0, 50_000, (n, 16), dtype=np.int32),
            "sampler_logps": rng.standard_normal((n, 16)).astype(np.float32),
            "completion_mask": rng.random((n, 16)) < 0.7,
            "policy_version": np.full(n, step, np.int32),
            "completions": np.asarray([f"answer {i}" for i in range(n)], object),
            "extras": np.asarray([{"tool": i} for i in range(n)], object)}  # no Arrow form: the side channel


@pytest.mark.slow  # 1-4 s (a Flight server and client start): the default tier is over its budget
def test_rows_cross_whole_in_order_with_their_host_objects_and_a_wrong_key_is_refused():
    link = _Link()
    train = FlightRows(link, "train", peer=2, rank=0, timeout_s=10.0, coordinator=LOOPBACK)
    rollout = FlightRows(link, "rollout", peer=0, rank=0, timeout_s=10.0)
    try:
        assert train.location.startswith("grpc://127.0.0.1:")
        assert link.values["rows-at/0"] == (train.location, train.token) and len(train.token) >= 32
        # The server listens on every interface: a client without this run's token is refused, writes nothing.
        with pytest.raises(DockError, match="refused this client's token"):
            RemoteDock(train.location, connect_timeout_s=5.0)
        with pytest.raises(DockError, match="refused this client's token"):
            RemoteDock(train.location, token="x" * 43, connect_timeout_s=5.0)
        assert len(train.dock) == 0
        sent = {key: _rows(s) for s, key in enumerate(["rows/0/0/0", "rows/0/1/0", "rows/1/0/0"])}
        for s, (key, rows) in enumerate(sent.items()):  # async: the rollout side runs ahead of the reader
            rollout.put(key, (rows, {"rollout/len": [float(s)]}))
        for s, (key, rows) in enumerate(list(sent.items())[:2]):
            got, logged = train.take(key, sender=2)
            assert logged == {"rollout/len": [float(s)]}
            assert sorted(got) == sorted(rows)
            for name, column in rows.items():  # the bits, dtype and shape of every column, the objects' values
                assert got[name].dtype == column.dtype and got[name].shape == column.shape, name
                assert got[name].tolist() == column.tolist(), name
        # hostile: the reader asks for a key the writer did not send next (another plan on one side)
        with pytest.raises(RuntimeError, match=r"^process 0: the rows from process 2 came as 'rows/1/0/0' where "
                                               r"'rows/1/1/0' was next; both groups must run the same plan$"):
            train.take("rows/1/1/0", sender=2)
    finally:
        rollout.close()
        train.close()


def test_arrow_carries_numbers_and_str_the_side_channel_the_rest():
    arrow, rest = arrow_columns(_rows(0))
    assert sorted(rest) == ["extras"]
    assert sorted(arrow) == ["completion_ids", "completion_mask", "completions", "policy_version", "sample_keys",
                             "sampler_logps"]
    assert advertised_host("localhost:1234") == advertised_host(None) == "127.0.0.1"


WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from rlbolt.distributed.group_rows import FlightRows
    from rlbolt.producer.dock.flight import wire

    class Link:
        def put(self, key, obj): pass  # the test's link holds the host objects already
        def take(self, key, stop=lambda: False, sender=None): return sys.argv[1], sys.argv[3]

    rows = FlightRows(Link(), "rollout", peer=0, rank=0, timeout_s=float(sys.argv[2]))
    n = 4
    cols = lambda s: {"sample_keys": np.full((n, 2), s, np.uint32), "completion_ids": np.full((n, 64), s, np.int32)}
    rows.put("rows/0/0/0", (cols(0), {}))
    whole = wire.messages

    def one_row_then_die(batch):  # the second micro batch: its first row crosses, then this process dies
        yield batch.slice(0, 1)
        print("HALF", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    wire.messages = one_row_then_die
    rows.put("rows/0/1/0", (cols(1), {}))
""")


@pytest.mark.slow
def test_a_rollout_process_killed_mid_put_is_named_with_its_last_rows_and_its_half_put_never_taken():
    lease = 2.0
    link = _Link()
    train = FlightRows(link, "train", peer=2, rank=0, timeout_s=lease, coordinator=LOOPBACK)
    link.values.clear()  # the address and token go on the writer's command line; the host objects are put here
    link.put("rows/0/0/0", ({}, {}))
    link.put("rows/0/1/0", ({}, {}))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, train.location, str(lease), train.token],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "HALF"  # (the writer's start may take longer than the deadline)
        assert writer.wait(30) == -signal.SIGKILL
        killed_at = time.monotonic()
        got, _ = train.take("rows/0/0/0", sender=2)  # the whole first micro batch
        assert got["completion_ids"].shape == (4, 64) and (got["completion_ids"] == 0).all()
        with pytest.raises(TimeoutError) as lost:
            train.take("rows/0/1/0", sender=2)
        elapsed = time.monotonic() - killed_at
    finally:
        writer.kill()
        writer.wait()
        train.close()
    assert len(train.dock) == 0  # the half-sent micro batch wrote nothing
    line = str(lost.value)
    assert "\n" not in line and line.startswith("process 0: nothing from process 2 under 'rows/0/1/0' for ")
    # the deadline passes first (the lease is 4/3 of it): the line says what the server knows of the writer
    assert "(trainer.prefetch_timeout_s=2; Arrow Flight rows): process '0' last answered " in line, line
    assert "its last step: 'rows/0/0/0', its last call: add (it is stopped or stuck" in line, line
    assert lease <= elapsed <= lease + SLACK_S, f"{elapsed:.1f} s from the kill to the line"
