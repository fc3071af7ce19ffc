"""Who may call a DockServer: a token on every call (refused without it, in one line), TLS on the
wire (a client verifies the server's certificate), and bad settings named in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlbolt.producer.dock import DockError, ExperienceDock
from rlbolt.producer.dock.flight import DockServer, DockUnreachable, RemoteDock
from rlbolt.producer.dock.flight.access import TOKEN_ENV

TLS = Path(__file__).resolve().parent / "tls"
CERT, KEY = TLS / "localhost-cert.pem", TLS / "localhost-key.pem"


@pytest.fixture
def serve():
    made = []

    def start(location="grpc://127.0.0.1:0", **kw):
        server = DockServer(ExperienceDock({"train": ("x",)}), location, lease_s=5.0, **kw)
        made.append(server)
        return server

    yield start
    for server in made:
        server.shutdown()


def _round_trip(dock: RemoteDock) -> np.ndarray:
    dock.add({"x": np.arange(3, dtype=np.int32)}, key="k")
    taken = dock.get("train", 3, timeout=5.0)
    return np.asarray(taken.batch["x"])


def test_a_token_server_takes_its_token_only(serve, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    server = serve(token="s3cret-Token")
    with RemoteDock(server.location, token="s3cret-Token", connect_timeout_s=5.0) as dock:
        assert _round_trip(dock).tolist() == [0, 1, 2]
    for token in (None, "s3cret-token", "s3cret-Token "[:-1] + "x"):  # none, another case, one character off
        with pytest.raises(DockError, match=r"^hello: the dock at grpc://127\.0\.0\.1:\d+ refused this client's "
                                            r"token; set the server's token here") as err:
            RemoteDock(server.location, token=token, connect_timeout_s=5.0)
        assert "\n" not in str(err.value)
    assert len(server.dock) == 0  # the refused clients wrote nothing


def test_the_token_comes_from_the_environment_on_both_sides(serve, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    server = serve()
    with RemoteDock(server.location, connect_timeout_s=5.0) as dock:
        assert _round_trip(dock).tolist() == [0, 1, 2]
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(DockError, match="refused this client's token"):
        RemoteDock(server.location, connect_timeout_s=5.0)
    monkeypatch.setenv(TOKEN_ENV, "")  # set but empty: no token, as unset
    with pytest.raises(DockError, match="refused this client's token"):
        RemoteDock(server.location, connect_timeout_s=5.0)


@pytest.mark.parametrize("token, says", [("", "empty"), ("tab\there", "not printable ASCII"),
                                         ("naïve", "not printable ASCII"), (" padded", "not printable ASCII")])
def test_a_bad_token_is_refused_in_one_line_before_listening(token, says):
    with pytest.raises(DockError, match=rf"^dock token: {says}; pass a printable ASCII token .*RLBOLT_DOCK_TOKEN"):
        DockServer(ExperienceDock({"train": ("x",)}), token=token)
    with pytest.raises(DockError, match=rf"^dock token: {says};"):
        RemoteDock("grpc://127.0.0.1:1", token=token)


def test_tls_serves_grpc_tls_and_the_client_verifies_the_certificate(serve, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    server = serve("grpc://localhost:0", tls_cert=CERT, tls_key=KEY, token="t")
    assert server.location.startswith("grpc+tls://localhost:")
    with RemoteDock(server.location, token="t", tls_root_cert=CERT, connect_timeout_s=5.0) as dock:
        assert _round_trip(dock).tolist() == [0, 1, 2]
    # Not verifiable against the system's roots (self-signed), and plain gRPC to a TLS port: no answer.
    with pytest.raises(DockUnreachable):
        RemoteDock(server.location, token="t", connect_timeout_s=3.0)
    with pytest.raises(DockUnreachable):
        RemoteDock(server.location.replace("grpc+tls", "grpc"), token="t", connect_timeout_s=3.0)


def test_tls_settings_are_named_in_one_line(tmp_path):
    with pytest.raises(DockError, match=r"^DockServer: tls_cert and tls_key go together"):
        DockServer(ExperienceDock({"train": ("x",)}), tls_cert=CERT)
    with pytest.raises(DockError, match=r"^tls_key: cannot read '.*missing\.pem' \(No such file or directory\); "
                                        r"pass a PEM file$"):
        DockServer(ExperienceDock({"train": ("x",)}), tls_cert=CERT, tls_key=tmp_path / "missing.pem")
    with pytest.raises(DockError, match=r"^tls_root_cert: cannot read"):
        RemoteDock("grpc+tls://localhost:1", tls_root_cert=tmp_path / "missing.pem")
