"""DockServer: one `ExperienceDock` served over Arrow Flight to the stages of other processes.

Calls map onto Flight's three verbs: `add`/`put` are `do_put` streams (the columns as Arrow record
batches, the arguments in the descriptor, the reply in the stream's metadata); `get` is `do_get`
(the arguments in the ticket, the taken rows as the stream, indices/keys in its schema metadata);
every other call is an action. A `put` is applied only once its whole stream has arrived (the rows
the writer announced in the descriptor), so a writer that dies mid-put leaves nothing behind.

Liveness: every client names its process and stage and beats every lease/4 seconds; the server
keeps each client's last call, its time and the last step (batch key) it wrote or took. A client
silent for longer than the lease closes the dock with one line naming it, so every blocked and
later call (the consumer's `get` first) raises that line as DockClosed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from rlbolt.producer.dock.flight import access, wire
from rlbolt.producer.dock.selection import DockError
from rlbolt.producer.dock.store import DockClosed, ExperienceDock

REPLY = b"rlbolt.reply"
_NO_STEP = object()


@dataclasses.dataclass
class ClientRecord:
    """What the server knows of one connected client.

    Attributes:
      process: the name the client gave its process.
      stage: the stage (or role) it serves.
      last_seen: monotonic seconds of its last call or heartbeat.
      last_call: the name of its last call (not counting heartbeats).
      last_step: the batch key it last wrote or took (None before its first).
      calls: calls served, heartbeats not counted.
    """

    process: str
    stage: str
    last_seen: float
    last_call: str = "hello"
    last_step: Hashable = None
    calls: int = 0


class DockServer(flight.FlightServerBase):
    """Serves an existing `ExperienceDock` to `RemoteDock` clients; it serves from construction.

    Args:
      dock: the dock (it stays usable in this process too).
      location: where to listen, `grpc://host:port` (port 0: a free one). `self.location` is
        that address with the port filled in; with host 0.0.0.0 (every interface), clients on
        other hosts use this host's name or address instead.
      lease_s: a client silent (no call, no heartbeat) for longer than this is declared lost and
        the dock is closed naming it; a consumer's `get` fails within about lease_s * 1.25.
      clock: monotonic seconds (injectable in tests).
      token: the token every call must carry (`rlbolt.producer.dock.flight.access`); default
        `$RLBOLT_DOCK_TOKEN`, and without either, calls are taken from anyone who reaches the port.
      tls_cert: the certificate (chain) PEM file: with `tls_key`, the server listens on
        `grpc+tls://` (a `grpc://` location is served with TLS).
      tls_key: the certificate's private key PEM file.
    """

    def __init__(self, dock: ExperienceDock, location: str = "grpc://127.0.0.1:0", *, lease_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, token: str | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None):
        if not lease_s > 0:
            raise DockError(f"DockServer: lease_s={lease_s!r} must be a positive number of seconds")
        token, tls = access.resolve_token(token), access.server_tls(tls_cert, tls_key)
        scheme = "grpc+tls" if tls else "grpc"
        if tls and location.startswith("grpc://"):
            location = "grpc+tls://" + location[len("grpc://"):]
        try:
            super().__init__(location, tls_certificates=tls,
                             middleware=None if token is None else {"token": access.TokenCheck(token)})
        except (pa.ArrowException, OSError) as exc:
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DockError(f"DockServer: cannot listen on {location!r} ({line}); pass {scheme}://<an address of "
                            "this host>:<a free port> (port 0: any free port)") from None
        self.dock, self.lease_s, self._clock = dock, float(lease_s), clock
        host = urlparse(location).hostname or "127.0.0.1"
        self.location = f"{scheme}://{host}:{self.port}"
        self.clients: dict[str, ClientRecord] = {}
        self.lost: str | None = None  # the line the dock was closed with, once a client was lost
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="dock-lease", daemon=True)
        self._watchdog.start()

    def shutdown(self) -> None:
        """Stops serving: a client's waiting `get` raises DockClosed ("the dock server is shutting
        down"), then the server stops. The dock itself stays as it is."""
        self._stop.set()
        self.dock._ring()  # wake the gets waiting for clients, which see _stop
        super().shutdown()

    # -- Flight verbs --------------------------------------------------------------------------
    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        """The calls without columns: hello, heartbeat, bye, discard, finish, close, stats, len."""
        args = wire.loads(action.body.to_pybytes()) if action.body is not None else {}
        return iter([wire.dumps(self._serve(action.type, args, lambda: self._act(action.type, args)))])

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        """`add` and `put`: the whole stream first (atomic), then one call on the dock."""
        args = wire.loads(descriptor.command)
        table = reader.read_all()  # a writer that dies mid-stream: an error here, or (seen) the rows that came
        reply = self._serve(args["call"], args, lambda: self._write(args, self._whole(args, table)))
        writer.write(pa.py_buffer(wire.dumps(reply)))

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        """`get`: waits on the dock as the call asks, then streams the taken rows."""
        args = wire.loads(ticket.ticket)
        out: dict[str, Any] = {}

        def take() -> dict:
            taken = self.dock.get(args["stage"], args["n"], whole_groups=args["whole_groups"],
                                  one_batch=args["one_batch"], timeout=args["timeout"], partial=args["partial"],
                                  _stop=self._stop)
            if taken.keys:
                self._touch(args["client"], "get", taken.keys[-1])
            out["batch"] = wire.to_record_batch(dict(taken.batch), "get")
            return {"indices": taken.indices.tolist(), "keys": [wire.key_to_json(k, "get") for k in taken.keys],
                    "timed_out": bool(taken.timed_out)}

        reply = self._serve("get", args, take)
        batch = out.get("batch")
        schema = (batch.schema if batch is not None else pa.schema([])).with_metadata({REPLY: wire.dumps(reply)})
        ok = batch is not None and reply.get("error") is None
        table = pa.Table.from_batches(wire.messages(batch.replace_schema_metadata(schema.metadata)) if ok else [],
                                      schema=schema)
        return flight.RecordBatchStream(table)

    # -- the calls -------------------------------------------------------------------------------
    def _serve(self, call: str, args: dict, fn: Callable[[], dict]) -> dict:
        try:
            if call not in ("hello", "heartbeat", "bye"):
                self._touch(args.get("client", "?"), call)
            return fn()
        except Exception as exc:  # noqa: BLE001  (every error crosses the wire as its type and line)
            return wire.error_reply(exc)

    def _act(self, call: str, args: dict) -> dict:
        client = args.get("client", "?")
        if call == "hello":
            return self._hello(client, args)
        if call == "heartbeat":
            self._touch(client, None)
            return {}
        if call == "bye":
            with self._lock:
                self.clients.pop(client, None)
            return {}
        if call == "discard":
            self.dock.discard(np.asarray(args["indices"], np.int64))
        elif call == "finish":
            self.dock.finish()
        elif call == "close":
            self.dock.close(args.get("reason"))
        elif call == "stats":
            return {name: dataclasses.asdict(s) for name, s in self.dock.stats(reset=args["reset"]).items()}
        elif call == "len":
            return {"len": len(self.dock)}
        else:
            raise DockError(f"unknown dock call {call!r}; calls: hello, heartbeat, bye, add, put, get, discard, "
                            "finish, close, stats, len")
        return {}

    def _hello(self, client: str, args: dict) -> dict:
        with self._lock:
            old = self.clients.get(client)
            if old is not None and self._clock() - old.last_seen <= self.lease_s:
                raise DockError(f"hello: a client named process {args['process']!r} stage {args['stage']!r} is "
                                "already connected; give each RemoteDock its own process (and stage) name")
            self.clients[client] = ClientRecord(args["process"], args["stage"], self._clock())
        return {"lease_s": self.lease_s}

    @staticmethod
    def _whole(args: dict, table: pa.Table) -> dict[str, np.ndarray]:
        """The put's columns, once every row it announced arrived (a stream cut by the writer's death can end
        like a whole one: pyarrow 26, a SIGKILLed client after its first message), else nothing is written."""
        if table.num_rows != args["rows"]:
            raise DockError(f"{args['call']}: {table.num_rows} of the {args['rows']} rows arrived (the writer "
                            "stopped mid-put); nothing was written")
        return wire.from_table(table)

    def _write(self, args: dict, arrays: dict[str, np.ndarray]) -> dict:
        call = args["call"]
        if call == "add":
            key = wire.key_from_json(args["key"])
            group_ids = None if args["group_ids"] is None else np.asarray(args["group_ids"])
            indices = self.dock.add(arrays, key=key, group_ids=group_ids, stages=args["stages"])
            self._touch(args["client"], "add", key)
            return {"indices": indices.tolist()}
        if call == "put":
            indices = np.asarray(args["indices"], np.int64)
            self.dock.put(arrays, indices)
            if len(indices):
                self._touch(args["client"], "put", self.dock.batch_key(indices[-1]))
            return {}
        raise DockError(f"unknown dock call {call!r} with columns; calls with columns: add, put")

    # -- liveness --------------------------------------------------------------------------------
    def _touch(self, client: str, call: str | None, step: Hashable = _NO_STEP) -> None:
        with self._lock:
            record = self.clients.get(client)
            if record is None:  # a call before hello (or after bye): known from now on
                process, _, stage = client.partition("/")
                record = self.clients[client] = ClientRecord(process, stage, self._clock())
            record.last_seen = self._clock()
            if call is not None:
                record.last_call, record.calls = call, record.calls + 1
            if step is not _NO_STEP:
                record.last_step = step

    def _watch(self) -> None:
        tick = min(0.5, self.lease_s / 4)
        while not self._stop.wait(tick):
            now = self._clock()
            with self._lock:
                late = [r for r in self.clients.values() if now - r.last_seen > self.lease_s]
                if late:
                    r = min(late, key=lambda r: r.last_seen)
                    step = "none yet" if r.last_step is None else repr(r.last_step)
                    self.lost = (f"process {r.process!r} (stage {r.stage!r}) stopped answering: no call or heartbeat "
                                 f"for {now - r.last_seen:.1f} s (lease {self.lease_s:g} s); its last step: {step}, "
                                 f"its last call: {r.last_call}")
                    self.clients.clear()
            if late:
                self.dock.close(self.lost)
                return



