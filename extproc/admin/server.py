"""Start-up of the admin gRPC server: check that the listener is safe (credentials off
loopback, TLS unless a proxy terminates it), put the bearer-token check in front of the
servicer, bind and serve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from extproc._gen.aiquota.v1 import admin_pb2_grpc
from extproc.admin.auth import BearerAuth, TokenFile, check_listen, server_credentials
from extproc.admin.errors import AdminConfigError
from extproc.admin.service import AdminServicer
from extproc.ports import add_grpc_port

log = structlog.get_logger("extproc.admin")


@dataclass
class AdminServer:
    """A started admin gRPC server."""

    server: Any
    port: int
    address: str

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (calls in flight get ``grace`` seconds)."""
        await self.server.stop(grace)


async def start_admin_server(
    servicer: AdminServicer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: TokenFile | str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    allow_plaintext: bool = False,
    reuse_port: bool = False,
) -> AdminServer:
    """Check the listener is safe (:class:`AdminConfigError`), then serve ``servicer``.
    ``token``: the token file (or, in tests, the token itself)."""
    if bool(tls_cert) != bool(tls_key):
        raise AdminConfigError("--admin-tls-cert and --admin-tls-key go together")
    check_listen(
        host,
        token=token is not None,
        tls=bool(tls_cert),
        client_certs=bool(tls_client_ca),
        allow_plaintext=allow_plaintext,
    )
    if isinstance(token, str):
        token = TokenFile.fixed(token)
    servicer.token = token
    interceptors = [BearerAuth(token, servicer.count_refused)] if token is not None else []
    server = grpc.aio.server(
        interceptors=interceptors, options=[("grpc.so_reuseport", 1 if reuse_port else 0)]
    )
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    creds = server_credentials(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None
    bound = add_grpc_port(server, address, what="admin API", credentials=creds)
    await server.start()
    log.info(
        "admin_serving",
        address=address,
        port=bound,
        tls=bool(tls_cert),
        token=token is not None,
        client_certs=bool(tls_client_ca),
    )
    return AdminServer(server, bound, address)
