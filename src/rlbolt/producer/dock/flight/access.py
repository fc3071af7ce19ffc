"""Who may call a DockServer: a shared token on every call, and TLS on the wire.

A dock served on every interface (`grpc://0.0.0.0:...`, as process groups serve their rows) takes
calls from any host that can reach the port; without a token, any of them could put rows the
trainer then trains on. With a token (`token=` on both sides, or `RLBOLT_DOCK_TOKEN` in both
environments) every call carries `authorization: Bearer <token>` and the server refuses a call
without it, compared in constant time. The token crosses the wire in the clear unless TLS is on:
a server given a certificate and key listens on `grpc+tls://`, and its clients verify it against
the root certificate they are given.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

import pyarrow.flight as flight

from rlbolt.producer.dock.selection import DockError

TOKEN_ENV = "RLBOLT_DOCK_TOKEN"
HEADER = "authorization"


def resolve_token(token: str | None) -> str | None:
    """`token`, else `$RLBOLT_DOCK_TOKEN`, else None (no token asked or sent).

    Args:
      token: the token given in code, or None.

    Raises:
      DockError: an empty token, or one with characters a header cannot carry.
    """
    value = os.environ.get(TOKEN_ENV) if token is None else token
    if value is None or value == "" and token is None:
        return None
    if not value or not value.isascii() or not value.isprintable() or value != value.strip():
        raise DockError(f"dock token: {'empty' if not value else 'not printable ASCII'}; pass a printable ASCII "
                        f"token without surrounding spaces (token= or ${TOKEN_ENV}), the same on server and clients")
    return value


def call_headers(token: str | None) -> list[tuple[bytes, bytes]]:
    """The headers a client sends with every call (none without a token).

    Args:
      token: the resolved token, or None.
    """
    return [] if token is None else [(HEADER.encode(), f"Bearer {token}".encode())]


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses every call whose `authorization` header is not `Bearer <token>`."""

    def __init__(self, token: str):
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[str | bytes]]) -> None:
        """Checks one call's headers (gRPC lower-cases their names).

        Args:
          info: the call's description (unused).
          headers: the call's headers, name -> values.
        """
        values = headers.get(HEADER, [])
        given = values[0] if len(values) == 1 else b""
        given = given.encode() if isinstance(given, str) else given
        if not hmac.compare_digest(given, self._expected):
            raise flight.FlightUnauthenticatedError("this dock takes calls with its token only")
        return None


def server_tls(cert: str | Path | None, key: str | Path | None) -> list[flight.CertKeyPair] | None:
    """The server's certificate chain and private key (PEM files), or None without TLS.

    Args:
      cert: the certificate (chain) PEM file, or None.
      key: its private key PEM file, or None.

    Raises:
      DockError: one of the two without the other, or a file that cannot be read.
    """
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise DockError("DockServer: tls_cert and tls_key go together (the certificate PEM and its private key PEM)")
    return [flight.CertKeyPair(_read(cert, "tls_cert"), _read(key, "tls_key"))]


def client_roots(root_cert: str | Path | None) -> bytes | None:
    """The PEM bytes a client verifies the server's certificate against, or None.

    Args:
      root_cert: a PEM file (the server's own certificate when self-signed), or None.
    """
    return None if root_cert is None else _read(root_cert, "tls_root_cert")


def _read(path: str | Path, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DockError(f"{field}: cannot read {str(path)!r} ({exc.strerror or exc}); pass a PEM file") from None


__all__ = ["HEADER", "TOKEN_ENV", "TokenCheck", "call_headers", "client_roots", "resolve_token", "server_tls"]
