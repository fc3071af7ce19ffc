"""The rollout rows between process groups over Arrow Flight: each training process serves a dock.

    rows = FlightRows(link, "train", peer=2, rank=0, timeout_s=60)     training process of data share 0
    rows = FlightRows(link, "rollout", peer=0, rank=0, timeout_s=60)   rollout process of data share 0
    rows.put("rows/<step>/<micro>/<share>", (columns, logged))         rollout process, in step order
    columns, logged = rows.take("rows/<step>/<micro>/<share>")         training process, the same order

Each training process serves an `ExperienceDock` of its share's rows (`DockServer`, on a free port
of every interface, taking calls that carry this run's token only: `$RLBOLT_DOCK_TOKEN`, else a fresh
random one) and publishes its address and token once, through the `GroupLink` (the coordination
service's key-value store), under `rows-at/<share>`; the rollout process of that share reads them at
its first put and from then on adds each micro batch's columns to that dock (`RemoteDock.add`,
keyed by the rows' key). Why the training process serves:
  - a put is one Flight stream that the server applies only once it has arrived whole, so a
    rollout process that dies mid-put leaves nothing in the dock the training process takes from;
  - the server's records name the writer and its last key: a training process's wait that passes
    the deadline (`trainer.prefetch_timeout_s`) ends in one line naming them, as does a writer's
    silence (its lease: killed, stopped) while the dock waits;
  - the training process waits on its own dock (a condition variable, no polling over the network),
    and in async mode the rollout process puts the steps it runs ahead without waiting for a reader.

What crosses: the columns Arrow carries (numbers, bool, fixed-size dtypes, str objects: `wire.py`)
as Arrow arrays; what is left (`RLModule.log` values, object columns holding other than str) as one
small pickle through the `GroupLink`, put before the columns, so it is there once they are.
A training process that takes a key other than the next one the dock holds is refused in one line.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from rlbolt.distributed.shutdown import skip_shutdown_barrier

log = logging.getLogger(__name__)
ROWS_STAGE = "train"  # the stage of the training process's dock: a micro batch is ready once added (whole)
_SLICE_S = 0.5  # a wait on the dock, between looks at `stop` and the deadline


def arrow_columns(columns: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`columns` split into (those Arrow carries, the rest): an object column goes with the rest unless it
    holds only str or None (the wire's rule; numbers and fixed-size dtypes always cross as Arrow)."""
    arrow, rest = {}, {}
    for name, values in columns.items():
        arr = np.asarray(values)
        objects = arr.dtype.kind == "O" and any(v is not None and not isinstance(v, str) for v in arr.reshape(-1))
        (rest if objects or arr.dtype.fields is not None else arrow)[name] = values
    return arrow, rest


def advertised_host(coordinator: str | None) -> str:
    """The address of this host that the other processes reach: the one it routes to the coordinator by
    (127.0.0.1 when the coordinator is on loopback or unknown)."""
    host = (coordinator or "").rpartition(":")[0].strip("[]")
    if not host or host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP: no packet is sent; the kernel picks the route's source address
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class FlightRows:
    """One training process's dock of rollout rows, or one rollout process's client of it (module doc).

    Args:
      link: the `GroupLink` (the address, once; the host objects of each micro batch).
      role: "train" (serves and takes) or "rollout" (puts).
      peer: the process on the other side (the rollout or training process of the same data share).
      rank: the data share's rank (the key the address goes under).
      timeout_s: the longest wait for a micro batch, and the writer's lease (silent longer: lost).
      coordinator: the coordination service's `host:port` (the address the server advertises is
        this host's route to it; default: `jax.distributed`'s).
    """

    def __init__(self, link: Any, role: str, *, peer: int, rank: int, timeout_s: float,
                 coordinator: str | None = None):
        from rlbolt.producer.dock import ExperienceDock
        from rlbolt.producer.dock.flight import DockServer
        from rlbolt.producer.dock.flight.access import resolve_token

        self.link, self.role, self.peer, self.rank, self.timeout_s = link, role, peer, rank, float(timeout_s)
        self.server, self._client = None, None
        if role == "train":
            if coordinator is None:
                from jax._src import distributed

                coordinator = distributed.global_state.coordinator_address
            self.dock = ExperienceDock({ROWS_STAGE: ("sample_keys",)})
            # The lease: a writer silent for the deadline (the `GroupLink`'s rule) is lost; its heartbeats come every
            # lease/4, so a lease of 4/3 the deadline never names a writer before the deadline from its last act.
            # Served on every interface, so only calls with this run's token are taken: a fresh one per run
            # (or $RLBOLT_DOCK_TOKEN), handed to the rollout process through the coordination service.
            self.token = resolve_token(None) or secrets.token_urlsafe(32)
            self.server = DockServer(self.dock, "grpc://0.0.0.0:0", lease_s=self.timeout_s * 4 / 3, token=self.token)
            self.location = f"grpc://{advertised_host(coordinator)}:{self.server.port}"
            link.put(f"rows-at/{rank}", (self.location, self.token))
            log.info("rollout rows of data share %d: Arrow Flight, served at %s", rank, self.location)

    def put(self, key: str, rows: tuple[Mapping[str, Any], Any]) -> None:
        """Rollout process: the micro batch's host objects through the link, then its columns into the dock.

        Args:
          key: the rows' key (`rows/<step>/<micro>/<share>`).
          rows: (columns, logged values).
        """
        columns, logged = rows
        arrow, rest = arrow_columns(columns)
        self.link.put(key, (rest, logged))
        self.client().add(arrow, key=key)

    def client(self) -> Any:
        """Rollout process: the `RemoteDock` of its training process (connects at the first call)."""
        if self._client is None:
            from rlbolt.producer.dock.flight import RemoteDock

            location, token = self.link.take(f"rows-at/{self.rank}", sender=self.peer)
            self._client = RemoteDock(location, process=str(jax.process_index()), stage="rollout",
                                      connect_timeout_s=self.timeout_s, call_timeout_s=self.timeout_s, token=token)
            log.info("rollout rows of data share %d: Arrow Flight, to %s", self.rank, location)
        return self._client

    def take(self, key: str, stop: Callable[[], bool] = lambda: False, sender: int | None = None
             ) -> tuple[dict[str, Any], Any]:
        """Training process: the next micro batch's columns (read-only arrays) and logged values.

        Args:
          key: the rows' key; the dock's oldest micro batch must be this one.
          stop: polled while waiting (True: give up).
          sender: the writing process (named in errors; default `peer`).

        Raises:
          TimeoutError: nothing within `timeout_s`, or the writer lost (its lease: silent that long), in
            one line naming it, its last key and `trainer.prefetch_timeout_s`; or `stop()` became True.
          RuntimeError: the dock's next micro batch has another key.
        """
        from rlbolt.producer.dock import DockClosed

        sender = self.peer if sender is None else sender
        me, began = jax.process_index(), time.monotonic()
        while True:
            try:
                taken = self.dock.get(ROWS_STAGE, one_batch=True, timeout=_SLICE_S)
            except DockClosed:
                taken = None
            waited = time.monotonic() - began
            if taken is not None and len(taken.indices):
                break
            if stop():
                raise TimeoutError(f"process {me}: stopped while waiting for {key!r}")
            if taken is None or waited > self.timeout_s:
                skip_shutdown_barrier()
                raise TimeoutError(f"process {me}: nothing from process {sender} under {key!r} for {waited:.0f} s "
                                   f"(trainer.prefetch_timeout_s={self.timeout_s:g}; Arrow Flight rows): "
                                   f"{self.last_words()}")
        if taken.keys[0] != key:
            raise RuntimeError(f"process {me}: the rows from process {sender} came as {taken.keys[0]!r} where "
                               f"{key!r} was next; both groups must run the same plan")
        rest, logged = self.link.take(key, stop, sender=sender)
        return {**dict(taken.batch), **rest}, logged

    def last_words(self) -> str:
        """Training process: what the server knows of the writer (the lease's line once it is lost)."""
        if self.server.lost is not None:
            return self.server.lost
        records = list(self.server.clients.values())
        if not records:
            return "it never connected (it is stopped or stuck before its first rows, or its step is slower)"
        r = records[0]
        return (f"process {r.process!r} last answered {time.monotonic() - r.last_seen:.0f} s ago, its last step: "
                f"{r.last_step!r}, its last call: {r.last_call} (it is stopped or stuck: see its stack, e.g. py-spy "
                "dump; or its step is slower: raise trainer.prefetch_timeout_s)")

    def close(self) -> None:
        """Stops serving (training process) or leaves the dock (rollout process)."""
        if self.server is not None:
            self.server.shutdown()
        if self._client is not None:
            self._client.disconnect()
