"""The dock across processes (Arrow Flight): columns cross exactly, errors cross unchanged, a
lost stage closes the dock in one line within the lease, a killed writer leaves nothing half
written, and three stage processes move the same batches as the same stages on one dock.

The API itself runs through RemoteDock in test_store.py (`make_dock`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rlbolt.producer.dock import DockClosed, DockError, ExperienceDock
from rlbolt.producer.dock.flight import DockServer, DockUnreachable, RemoteDock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import flight_stages  # noqa: E402

# Scheduling slack on top of a stated time (lease * 1.25): two shared CPU cores may delay the
# watchdog's or the waiting thread's wake-up by a fraction of a second under load.
SLACK_S = 1.5


@pytest.fixture
def served():
    made = []

    def serve(stages, lease_s=5.0, **kw):
        dock = ExperienceDock(stages, **kw)
        server = DockServer(dock, lease_s=lease_s)
        made.append(server)
        return dock, server

    yield serve
    for server in made:
        server.shutdown()


def test_columns_cross_with_their_dtype_shape_and_bits(served):
    rng = np.random.default_rng(0)
    n = 5
    columns = {
        "tokens": rng.integers(-2**31, 2**31 - 1, (n, 3, 4), dtype=np.int32),
        "logps": rng.standard_normal(n).astype(np.float32),
        "nan_inf": np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32),  # bits, not values
        "mask": rng.random((n, 6)) < 0.5,
        "bf16": rng.standard_normal((n, 2)).astype(ml_dtypes.bfloat16),
        "fp8": rng.standard_normal((n, 3)).astype(ml_dtypes.float8_e4m3fn),
        "big_endian": np.arange(n, dtype=">i8"),
        "u64": np.array([0, 1, 2**63, 2**64 - 1, 7], np.uint64),
        "text": np.array(["", "a", "héllo", "x" * 300, "\n"]),
        "answers": np.array(["42", None, "ünï", "", "7"], object),
        "answer_pairs": np.array([[f"{i}a", f"{i}b"] for i in range(n)], object),
        "empty_rows": np.zeros((n, 0, 3), np.float64),
        "complex": (rng.standard_normal(n) + 1j).astype(np.complex64),
    }
    dock, server = served({"train": ("tokens",)})
    with RemoteDock(server.location, process="writer", stage="rollout") as remote:
        idx = remote.add({"tokens": columns["tokens"]}, key=("step", 3))
        remote.put({k: v for k, v in columns.items() if k != "tokens"}, idx)
        taken = remote.get("train", n=n)
    assert taken.keys == [("step", 3)] * n and not taken.timed_out
    assert taken.indices.dtype == np.int64 and taken.indices.tolist() == list(range(n))
    assert sorted(taken.batch) == sorted(columns)
    for name, sent in columns.items():
        got = taken.batch[name]
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape), name
        if sent.dtype == object:
            assert got.tolist() == sent.tolist(), name
        else:
            assert got.tobytes() == sent.tobytes(), name
    assert not taken.batch["tokens"].flags.writeable  # a view of the received buffer


def test_large_puts_and_gets_cross_in_several_messages(served, monkeypatch):
    from rlbolt.producer.dock.flight import wire

    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 1000)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 100, (64, 10), dtype=np.int32)
    logps = rng.standard_normal((64, 10)).astype(ml_dtypes.bfloat16)
    answers = np.array([f"a{i}" for i in range(64)], object)
    messages = wire.messages(wire.to_record_batch({"ids": ids, "logps": logps, "answer": answers}, "put"))
    assert len(messages) >= 4 and sum(m.num_rows for m in messages) == 64  # 64 x 60 bytes of numbers alone
    dock, server = served({"train": ("ids", "logps")})
    with RemoteDock(server.location, process="writer", stage="rollout") as remote:
        idx = remote.add({"answer": answers})
        remote.put({"ids": ids, "logps": logps}, idx)
        batch, got = remote.get("train", n=64)
    assert got.tolist() == list(range(64)) and batch["answer"].tolist() == answers.tolist()
    assert batch["ids"].tobytes() == ids.tobytes() and batch["logps"].tobytes() == logps.tobytes()


def test_errors_cross_unchanged_and_bad_columns_are_refused_in_one_line(served):
    dock, server = served({"train": ("text",)}, columns=("text",))
    with RemoteDock(server.location, process="p", stage="train") as remote:
        # a column the server refuses: the server's line, unchanged, as the same type
        with pytest.raises(DockError) as remote_error:
            remote.add({"text": np.arange(2), "txet": np.arange(2)})
        with pytest.raises(DockError) as local_error:
            dock.add({"text": np.arange(2), "txet": np.arange(2)})
        assert str(remote_error.value) == str(local_error.value) == (
            "add: unknown column(s) ['txet']; columns: ['text']")
        assert len(remote) == 0
        with pytest.raises(DockError, match=r"^add: column 'text' holds a dict among its objects; across processes "
                                            r"an object column may hold only str \(or None\)$"):
            remote.add({"text": np.array([{"a": 1}, "b"], object)})
        with pytest.raises(DockError, match=r"^add: key <object object at .*> of type object cannot cross"):
            remote.add({"text": np.arange(1)}, key=object())
        with pytest.raises(DockError, match=r"^put: column 'text' has a structured dtype"):
            remote.put({"text": np.zeros(1, [("a", "i4"), ("b", "f4")])}, [0])
        assert len(remote) == 0  # nothing half-added
        remote.close("the test stopped it")
        with pytest.raises(DockClosed, match=r"^get: the dock is closed: the test stopped it$"):
            remote.get("train", n=1)


def test_a_location_that_does_not_answer_is_named_in_one_line():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(DockUnreachable) as refused:
        RemoteDock(f"grpc://127.0.0.1:{port}", process="p", connect_timeout_s=5.0)
    message = str(refused.value)
    assert message.startswith(f"hello: the dock at grpc://127.0.0.1:{port} does not answer (") and "\n" not in message
    assert time.monotonic() - start < 5.0  # refused at once, not at the deadline
    with socket.socket() as silent:  # accepts connections and never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(DockUnreachable, match=rf"^hello: the dock at grpc://127.0.0.1:{port} did not answer "
                                                  r"within 0.5 s; is its DockServer running"):
            RemoteDock(f"grpc://127.0.0.1:{port}", process="p", connect_timeout_s=0.5)
    with pytest.raises(DockUnreachable, match=r"^RemoteDock: cannot use location 'nowhere'"):
        RemoteDock("nowhere", process="p")
    dock = ExperienceDock({"train": ("x",)})
    server = DockServer(dock)
    try:  # a server's address already taken: one line naming it
        with pytest.raises(DockError, match=rf"^DockServer: cannot listen on '{server.location}' \(.*\); pass grpc://"):
            DockServer(dock, server.location)
    finally:
        server.shutdown()
    assert isinstance(refused.value, DockClosed)  # a pipeline that stops on DockClosed stops on it too


def test_a_silent_client_closes_the_dock_naming_it_within_the_lease(served):
    lease = 0.6
    dock, server = served(flight_stages.STAGES, lease_s=lease)
    writer = RemoteDock(server.location, process="rollout-3", stage="rollout")
    consumer = RemoteDock(server.location, process="trainer-0", stage="train")
    idx = writer.add(flight_stages.prompts(0, 4), key=0)
    writer.put(flight_stages.completions(np.ones((4, 5), np.int32)), idx)
    time.sleep(1.5 * lease)
    assert server.lost is None  # heartbeats keep an idle client alive
    failed = {}

    def consume():
        try:
            consumer.get("train", n=4, timeout=lease * 1.25 + SLACK_S + 2)  # ref_logps never comes
        except DockClosed as exc:
            failed["at"], failed["error"] = time.monotonic(), exc

    thread = threading.Thread(target=consume)
    thread.start()
    writer._stop.set()  # the writer stops answering (no heartbeat, no goodbye)
    silent_from = time.monotonic()
    thread.join(lease * 1.25 + SLACK_S + 2)
    assert "error" in failed, "the consumer's get did not fail"
    assert failed["at"] - silent_from <= lease * 1.25 + SLACK_S
    line = str(failed["error"])
    assert "\n" not in line
    assert line.startswith("get: the dock is closed: process 'rollout-3' (stage 'rollout') stopped answering: "
                           "no call or heartbeat for ")
    assert line.endswith(f"(lease {lease:g} s); its last step: 0, its last call: put")
    with pytest.raises(DockClosed, match="process 'rollout-3'"):
        consumer.put({"ref_logps": np.ones(4)}, idx)
    consumer.disconnect()


def test_a_client_that_leaves_is_not_lost_and_names_are_unique(served):
    dock, server = served({"train": ("x",)}, lease_s=0.3)
    with RemoteDock(server.location, process="p", stage="train"):
        with pytest.raises(DockError, match=r"^hello: a client named process 'p' stage 'train' is already connected"):
            RemoteDock(server.location, process="p", stage="train")
    time.sleep(2 * 0.3 + 0.2)  # two leases and a watchdog tick
    assert server.lost is None and server.clients == {}


def test_shutdown_ends_a_waiting_get(served):
    dock, server = served({"train": ("x",)})
    remote = RemoteDock(server.location, process="trainer-0", stage="train")
    failed, stopped = [], threading.Event()
    waiter = threading.Thread(target=lambda: failed.append(_raised(lambda: remote.get("train", n=1))), daemon=True)
    waiter.start()
    time.sleep(0.2)
    threading.Thread(target=lambda: (server.shutdown(), stopped.set()), daemon=True).start()
    assert stopped.wait(5), "shutdown waited for a get that waits for samples"
    waiter.join(5)
    assert failed == ["DockClosed: get: the dock server is shutting down"]
    assert not dock._closed  # the dock itself stays open for its own process


def _raised(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _start(role: str, location: str, **args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "flight_stages.py"), role, location, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_writer_killed_mid_put_is_reported_and_its_half_put_never_taken(served):
    import os
    import signal

    lease = 1.0
    dock, server = served(flight_stages.STAGES, lease_s=lease)
    first = dock.add(flight_stages.prompts(0, 4), key=0)
    second = dock.add(flight_stages.prompts(1, 4), key=1)
    for idx in (first, second):  # the reference's column is there already: only completions are owed
        dock.put({"ref_logps": np.zeros(4, ml_dtypes.bfloat16)}, idx)
    writer = _start("killed_writer", server.location, indices=first.tolist() + second.tolist())
    try:
        assert writer.stdout.readline().strip() == "READY", writer.stdout.read()
        consumer = RemoteDock(server.location, process="trainer-0", stage="train")
        taken = consumer.get("train", n=4, timeout=10)  # the whole put: step 0
        assert taken.indices.tolist() == first.tolist() and taken.keys == [0] * 4
        assert server.lost is None
        os.kill(writer.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(DockClosed) as lost:
            consumer.get("train", n=4, timeout=10)  # (a time-out only so that a failure cannot hang)
        elapsed = time.monotonic() - killed_at
    finally:
        writer.kill()
        writer.wait()
    written = dock._rows.columns["completion_ids"].where
    assert not set(second.tolist()) & set(written)  # the half-sent put wrote nothing
    line = str(lost.value)
    assert line.startswith("get: the dock is closed: process 'killed_writer-0' (stage 'killed_writer') stopped "
                           "answering") and "\n" not in line
    assert line.endswith("its last step: 0, its last call: put")
    assert elapsed <= lease * 1.25 + SLACK_S
    consumer.disconnect()


@pytest.mark.slow
def test_three_processes_move_the_same_batches_as_one_dock(served):
    steps, batch, sizes = 3, 8, {"rollout": 3, "reference": 5}
    local = ExperienceDock(flight_stages.STAGES)
    threads = [threading.Thread(target=getattr(flight_stages, role), args=(local, steps, batch, micro))
               for role, micro in sizes.items()]
    for t in threads:
        t.start()
    expected = flight_stages.train(local, steps, batch)
    for t in threads:
        t.join(10)

    dock, server = served(flight_stages.STAGES, lease_s=5.0)
    procs = [_start(role, server.location, steps=steps, batch=batch, micro=micro) for role, micro in sizes.items()]
    try:
        with RemoteDock(server.location, process="trainer-0", stage="train") as trainer:
            got = flight_stages.train(trainer, steps, batch)
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for step, (want, have) in enumerate(zip(expected, got)):
        assert have.indices.tolist() == want.indices.tolist() == list(range(step * batch, (step + 1) * batch))
        assert have.keys == want.keys == [step] * batch
        assert sorted(have.batch) == sorted(want.batch)
        for name in want.batch:
            a, b = want.batch[name], have.batch[name]
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert a.tolist() == b.tolist() if a.dtype == object else a.tobytes() == b.tobytes(), name
        # and both are the stage functions applied to the step's prompts (independent of any dock)
        rows = flight_stages.prompts(step, batch)
        made = {**rows, **flight_stages.completions(rows["prompt_ids"])}
        made.update(flight_stages.reference_logps(made["completion_ids"]))
        for name, value in made.items():
            assert have.batch[name].tolist() == value.tolist(), name
    assert len(dock) == 0 and dock.stats()["train"].samples == steps * batch


@pytest.mark.slow
def test_a_killed_server_fails_a_waiting_get_in_one_line():
    import os
    import signal

    server = _start("server", "grpc://127.0.0.1:0")
    try:
        location = server.stdout.readline().strip()
        assert location.startswith("grpc://127.0.0.1:"), location + server.stdout.read()
        remote = RemoteDock(location, process="trainer-0", stage="train")
        failed = []
        waiter = threading.Thread(target=lambda: failed.append(_raised(lambda: remote.get("train", n=1))), daemon=True)
        waiter.start()
        time.sleep(0.3)
        os.kill(server.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        waiter.join(10)
        elapsed = time.monotonic() - killed_at
    finally:
        server.kill()
        server.wait()
    assert failed and failed[0].startswith(f"DockUnreachable: get: the dock at {location} does not answer (")
    assert failed[0].endswith("); is its DockServer running there (not stopped), and the location right?")
    assert "\n" not in failed[0] and elapsed < 5  # the broken connection, not a deadline
    with pytest.raises(DockUnreachable, match=rf"^put: the dock at {location} does not answer"):
        remote.put({"x": np.ones(1)}, [0])


@pytest.mark.slow
def test_a_server_that_stops_answering_fails_a_waiting_get_within_the_lease():
    import os
    import signal

    lease = 1.0
    server = _start("server", "grpc://127.0.0.1:0", lease_s=lease)
    try:
        location = server.stdout.readline().strip()
        remote = RemoteDock(location, process="trainer-0", stage="train")
        failed = []
        waiter = threading.Thread(target=lambda: failed.append(_raised(lambda: remote.get("train", n=1))), daemon=True)
        waiter.start()
        time.sleep(0.3)
        os.kill(server.pid, signal.SIGSTOP)  # hung or cut off: the connection stays open, nothing answers
        stopped_at = time.monotonic()
        waiter.join(lease * 1.25 + SLACK_S + 5)
        elapsed = time.monotonic() - stopped_at
    finally:
        server.kill()
        server.wait()
    assert failed and failed[0].startswith(f"DockUnreachable: get: the dock at {location} stopped answering: no reply "
                                           "to a heartbeat for ")
    assert failed[0].endswith(f"(lease {lease:g} s)") and "\n" not in failed[0]
    # the last reply came at most lease/4 before the stop; the call looks every lease/4 after a lease
    assert elapsed <= lease * 1.25 + SLACK_S
