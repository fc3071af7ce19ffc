"""RemoteDock: the `ExperienceDock` calls of a stage in another process, served by a `DockServer`.

The same methods, arguments, results (`Taken` with indices, keys and timed_out; `StageStats`)
and errors (`DockError`, `DockClosed`, with the server's line unchanged) as the dock itself, so a
stage written against `ExperienceDock` runs against a `RemoteDock` unchanged. Rows arrive as
read-only arrays (views of the received Arrow buffers).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.flight as flight

from rlbolt.batch import Batch
from rlbolt.producer.dock.columns import as_arrays, common_size
from rlbolt.producer.dock.flight import access, wire
from rlbolt.producer.dock.flight.server import REPLY
from rlbolt.producer.dock.queues import StageStats
from rlbolt.producer.dock.selection import DockError
from rlbolt.producer.dock.store import DockClosed, Taken, as_indices


class DockUnreachable(DockClosed):
    """The dock server does not answer (not started, wrong location, gone, or cut off)."""


class RemoteDock:
    """A client of a `DockServer`: the dock's calls for one process and stage.

    Args:
      location: the server's address, `grpc://host:port` (`DockServer.location`).
      process: this process's name in the server's liveness records and in the line that
        reports it lost (default: host:pid).
      stage: the stage (or role) this client serves, for the same records.
      connect_timeout_s: how long the first call may take before the location is reported
        as not answering.
      call_timeout_s: the most seconds any call other than a blocking `get` may take; a `get`
        with a time-out gets that time-out plus this.
      token: the server's token, sent with every call (`rlbolt.producer.dock.flight.access`);
        default `$RLBOLT_DOCK_TOKEN`, else none.
      tls_root_cert: the PEM file to verify a `grpc+tls://` server's certificate against (its own
        certificate when self-signed); None: the system's roots.

    Example:
      dock = RemoteDock(server_location, process="rollout-0", stage="rollout")
      batch, idx = dock.get("rollout", n=8, one_batch=True)
      dock.put({"completion_ids": ids}, idx)
    """

    def __init__(self, location: str, *, process: str | None = None, stage: str = "-",
                 connect_timeout_s: float = 10.0, call_timeout_s: float = 60.0, token: str | None = None,
                 tls_root_cert: str | Path | None = None):
        self.location = location
        self.process = process or f"{socket.gethostname()}:{os.getpid()}"
        self.stage = stage
        self._id = f"{self.process}/{stage}"
        self._call_timeout = float(call_timeout_s)
        self._headers = access.call_headers(access.resolve_token(token))
        roots = access.client_roots(tls_root_cert)
        try:
            self._client = flight.FlightClient(location, tls_root_certs=roots)
            self._beat_client = flight.FlightClient(location, tls_root_certs=roots)
        except (flight.FlightError, OSError, ValueError) as exc:
            raise DockUnreachable(f"RemoteDock: cannot use location {location!r} ({_first_line(exc)}); "
                                  "pass the grpc://host:port (grpc+tls:// with TLS) a DockServer listens on") from None
        reply = self._act("hello", {"process": self.process, "stage": stage}, timeout=connect_timeout_s)
        self.lease_s = float(reply["lease_s"])
        self._answered_at = time.monotonic()  # the last reply to a heartbeat
        self._stop = threading.Event()
        self._helpers = _Helpers(f"dock-get-{stage}")
        self._beat = threading.Thread(target=self._heartbeat, name=f"dock-heartbeat-{stage}", daemon=True)
        self._beat.start()
        atexit.register(self.disconnect)

    # -- the dock's calls --------------------------------------------------------------------------
    def add(self, columns: Mapping[str, Any], *, key: Hashable = None, group_ids: Any = None,
            stages: Sequence[str] | None = None) -> np.ndarray:
        """As `ExperienceDock.add`: new samples, one per row of `columns`; their [N] int64 indices."""
        arrays = as_arrays(columns, "add")
        common_size(arrays, "add")
        args = {"key": wire.key_to_json(key, "add"),
                "group_ids": None if group_ids is None else np.asarray(group_ids).tolist(),
                "stages": None if stages is None else list(stages)}
        return np.asarray(self._write("add", arrays, args)["indices"], np.int64)

    def put(self, columns: Mapping[str, Any], indices: Any) -> None:
        """As `ExperienceDock.put`: writes columns for existing samples (all of them, or none)."""
        idx = as_indices(indices, "put")
        arrays = as_arrays(columns, "put")
        common_size(arrays, "put")
        self._write("put", arrays, {"indices": idx.tolist()})

    def get(self, stage: str, n: int | None = None, *, whole_groups: bool = False, one_batch: bool = False,
            timeout: float | None = None, partial: bool = True) -> Taken:
        """As `ExperienceDock.get` (the server waits; this call's deadline is `timeout` plus
        call_timeout_s, none when `timeout` is None). A server that stops answering heartbeats
        for longer than its lease fails a waiting call with DockUnreachable."""
        args = {"call": "get", "client": self._id, "stage": stage, "n": _plain(n), "whole_groups": bool(whole_groups),
                "one_batch": bool(one_batch), "timeout": None if timeout is None else float(timeout),
                "partial": bool(partial)}
        deadline = None if timeout is None else max(0.0, float(timeout)) + self._call_timeout
        ticket, options = flight.Ticket(wire.dumps(args)), self._options(deadline)
        if timeout is not None and timeout <= self.lease_s / 4:  # short: no need to watch the server
            with self._calling("get", deadline):
                table = self._client.do_get(ticket, options).read_all()
        else:
            table = self._watched("get", deadline, lambda: self._client.do_get(ticket, options).read_all())
        reply = wire.loads(table.schema.metadata[REPLY])
        wire.raise_if_error(reply)
        batch = Batch(wire.from_table(table)) if table.num_columns else Batch()
        keys = [wire.key_from_json(k) for k in reply["keys"]]
        return Taken(batch, np.asarray(reply["indices"], np.int64), keys, reply["timed_out"])

    def discard(self, indices: Any) -> None:
        """As `ExperienceDock.discard`."""
        self._act("discard", {"indices": as_indices(indices, "discard").tolist()})

    def finish(self) -> None:
        """As `ExperienceDock.finish`: no more samples will be added (for every client)."""
        self._act("finish", {})

    def close(self, reason: str | None = None) -> None:
        """As `ExperienceDock.close`: stops the dock for every client (see `disconnect` to leave)."""
        self._act("close", {"reason": reason})

    def stats(self, reset: bool = True) -> dict[str, StageStats]:
        """As `ExperienceDock.stats`."""
        return {name: StageStats(**s) for name, s in self._act("stats", {"reset": bool(reset)}).items()}

    def __len__(self) -> int:
        """As `len(ExperienceDock)`: samples the dock holds."""
        return int(self._act("len", {})["len"])

    # -- this client -----------------------------------------------------------------------------
    def disconnect(self) -> None:
        """Leaves: stops the heartbeat and tells the server this client is gone on purpose (so
        its silence is not a lost stage). The dock itself stays open. Called at exit too."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.disconnect)
        with contextlib.suppress(Exception):
            self._act("bye", {}, timeout=min(self._call_timeout, 5.0))
        self._beat.join(timeout=5.0)
        self._helpers.stop()
        for client in (self._client, self._beat_client):
            with contextlib.suppress(Exception):
                client.close()

    def __enter__(self) -> RemoteDock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

    # -- internals --------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        interval = self.lease_s / 4
        body = wire.dumps({"client": self._id})
        while not self._stop.wait(interval):
            with contextlib.suppress(Exception):  # a server gone is reported by the next call
                list(self._beat_client.do_action(flight.Action("heartbeat", body), self._options(self.lease_s)))
                self._answered_at = time.monotonic()

    def _watched(self, call: str, deadline: float | None, fn: Callable[[], Any]) -> Any:
        """fn() on a helper thread while this one watches the heartbeats: a server that has not
        answered one for longer than the lease (stopped, hung, cut off: its connection may stay
        open) fails the call in one line instead of leaving it waiting."""
        def call_fn() -> Any:
            with self._calling(call, deadline):
                return fn()

        done, box = self._helpers.run(call_fn)
        while not done.wait(self.lease_s / 4):
            silent = time.monotonic() - self._answered_at
            if silent > self.lease_s:
                raise DockUnreachable(f"{call}: the dock at {self.location} stopped answering: no reply to a "
                                      f"heartbeat for {silent:.1f} s (lease {self.lease_s:g} s)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _act(self, call: str, args: dict, timeout: float | None = None) -> dict:
        body = wire.dumps({"client": self._id, **args})
        deadline = self._call_timeout if timeout is None else timeout
        with self._calling(call, deadline):
            results = list(self._client.do_action(flight.Action(call, body), self._options(deadline)))
        reply = wire.loads(results[0].body.to_pybytes())
        wire.raise_if_error(reply)
        return reply

    def _write(self, call: str, arrays: dict[str, np.ndarray], args: dict) -> dict:
        batch = wire.to_record_batch(arrays, call)
        descriptor = flight.FlightDescriptor.for_command(wire.dumps({"call": call, "client": self._id,
                                                                     "rows": batch.num_rows, **args}))
        with self._calling(call, self._call_timeout):
            writer, reader = self._client.do_put(descriptor, batch.schema, self._options(self._call_timeout))
            for message in wire.messages(batch):
                writer.write_batch(message)
            writer.done_writing()
            buf = reader.read()
            writer.close()
        reply = wire.loads(buf.to_pybytes())
        wire.raise_if_error(reply)
        return reply

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(timeout=timeout, headers=self._headers)

    @contextlib.contextmanager
    def _calling(self, call: str, deadline: float | None) -> Iterator[None]:
        try:
            yield
        except flight.FlightUnauthenticatedError:
            raise DockError(f"{call}: the dock at {self.location} refused this client's token; set the server's "
                            f"token here (token=, or the same ${access.TOKEN_ENV} on both sides)") from None
        except flight.FlightTimedOutError:
            raise DockUnreachable(f"{call}: the dock at {self.location} did not answer within {deadline:g} s; "
                                  "is its DockServer running and reachable from here?") from None
        except (flight.FlightUnavailableError, flight.FlightCancelledError) as exc:
            raise DockUnreachable(f"{call}: the dock at {self.location} does not answer ({_first_line(exc)}); "
                                  "is its DockServer running there (not stopped), and the location right?") from None


class _Helpers:
    """Threads that make the waiting calls while the caller watches the heartbeats; an idle one
    is reused (a new thread's first Flight call costs about a millisecond more), and there are
    as many as calls wait at once (a call never queues behind another's wait)."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []
        self._all: list[queue.SimpleQueue] = []

    def run(self, fn: Callable[[], Any]) -> tuple[threading.Event, dict]:
        """Starts fn() on a helper; returns (done, box): box holds "value" or "error" once done."""
        done, box = threading.Event(), {}
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
            if jobs is None:
                jobs = queue.SimpleQueue()
                self._all.append(jobs)
                threading.Thread(target=self._serve, args=(jobs,), name=self._name, daemon=True).start()
        jobs.put((fn, done, box))
        return done, box

    def stop(self) -> None:
        """Ends every helper once its call returns."""
        with self._lock:
            for jobs in self._all:
                jobs.put(None)
            self._all, self._idle = [], []

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, done, box = job
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001  (raised on the caller's thread)
                box["error"] = exc
            with self._lock:
                self._idle.append(jobs)
            done.set()


def _plain(n: Any) -> Any:
    """n as JSON can carry it (the server's dock judges it)."""
    if isinstance(n, (np.integer, np.floating)):
        return n.item()
    return n if n is None or isinstance(n, (bool, int, float, str)) else repr(n)


def _first_line(exc: BaseException) -> str:
    """gRPC's own words from a Flight error ("Connection refused", "Socket closed"), short."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    found = re.search(r"with message: (.*?)(?:\. gRPC client debug context|$)", text)
    return (found.group(1) if found else text)[:160]
