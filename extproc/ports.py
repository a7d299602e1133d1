"""Opening the listening ports of ``ai-quota serve`` (gRPC, admin, metrics), with one error for
all of them: :class:`ListenError` names the port's role, the address and, when the system says
it, why (``ai-quota serve`` turns it into exit status 2 and one line)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any


class ListenError(OSError):
    """A listening port could not be opened (in use, not an address of this host, ...)."""

    def __init__(self, what: str, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address} for the {what}: {reason}")
        self.what = what
        self.address = address
        self.reason = reason


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` into host and port (``ValueError`` when malformed)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


def why_not(address: str) -> str:
    """What the system says when we try to bind ``address`` ourselves (after grpc could not:
    grpcio's error does not carry the reason)."""
    try:
        host, port = split_address(address)
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (ValueError, OSError) as exc:
        return str(exc)
    for family, kind, proto, _name, sockaddr in infos:
        with contextlib.closing(socket.socket(family, kind, proto)) as s:
            try:
                s.bind(sockaddr)
            except OSError as exc:
                return exc.strerror or str(exc)
    return "the gRPC server refused the address"


def add_grpc_port(server: Any, address: str, *, what: str, credentials: Any = None) -> int:
    """Bind ``address`` on a not yet started ``grpc.aio`` server; the port bound (the one picked
    for port 0).  :class:`ListenError` when it cannot be bound: grpcio raises ``RuntimeError``
    (older versions returned port 0)."""
    try:
        if credentials is not None:
            port = int(server.add_secure_port(address, credentials))
        else:
            port = int(server.add_insecure_port(address))
    except RuntimeError:
        port = 0
    if port == 0:
        raise ListenError(what, address, why_not(address))
    return port


def serve_metrics(port: int, host: str, registry: Any) -> Any:
    """Serve ``registry`` over HTTP on ``host:port`` (a daemon thread); the server, whose
    ``shutdown()`` stops it.  :class:`ListenError` when the port cannot be opened."""
    from prometheus_client import start_http_server

    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ListenError("Prometheus metrics", address, exc.strerror or str(exc)) from exc
    return httpd
