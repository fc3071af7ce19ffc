"""The ExperienceDock across processes over Apache Arrow Flight (gRPC carrying Arrow record batches).

    server = DockServer(ExperienceDock(stages), "grpc://0.0.0.0:8815", lease_s=5.0)   # one process
    dock = RemoteDock("grpc://host:8815", process="rollout-0", stage="rollout")     # any process

`server.py` serves a dock (calls, atomic puts, client leases); `client.py` is `RemoteDock`, a
drop-in for `ExperienceDock`; `wire.py` is what crosses the wire (columns as Arrow, keys and
arguments as JSON, errors as type name and line).
"""

from rlbolt.producer.dock.flight.client import DockUnreachable, RemoteDock
from rlbolt.producer.dock.flight.server import ClientRecord, DockServer

__all__ = ["ClientRecord", "DockServer", "DockUnreachable", "RemoteDock"]
