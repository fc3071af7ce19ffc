"""`make_dock`: the same dock tests on an in-process `ExperienceDock` and, through a `RemoteDock`,
on one served by a `DockServer` thread over loopback Arrow Flight."""

from __future__ import annotations

import pytest

from rlbolt.producer.dock import ExperienceDock


@pytest.fixture(params=["local", "remote"])
def make_dock(request):
    """A factory `make(stages, **kw)` with ExperienceDock's arguments: the dock itself, or a
    RemoteDock client of it (the server and client are shut down after the test)."""
    made = []

    def make(stages, **kw):
        dock = ExperienceDock(stages, **kw)
        if request.param == "local":
            return dock
        from rlbolt.producer.dock.flight import DockServer, RemoteDock

        server = DockServer(dock)
        client = RemoteDock(server.location, process="test", stage=f"client{len(made)}")
        made.append((server, client))
        return client

    yield make
    for server, client in made:
        client.disconnect()
        server.shutdown()
