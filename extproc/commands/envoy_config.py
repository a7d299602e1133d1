"""``ai-quota envoy-config``: print (or write) an Envoy bootstrap with the ext_proc filter for
the given ports, upstreams and processor replicas (:mod:`extproc.envoy_config` renders it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.envoy_config import GrpcClientAuth


def configure_parser(e: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota envoy-config``."""
    e.add_argument("--listen-host", default="127.0.0.1")
    e.add_argument("--listen-port", type=int, default=10000)
    e.add_argument("--admin-port", type=int, default=9901)
    e.add_argument("--upstream", action="append", help="host:port of the model server (repeatable)")
    e.add_argument(
        "--extproc", action="append", help="host:port of an ext_proc replica (repeatable)"
    )
    e.add_argument("--max-body-bytes", type=int, default=1_048_576)
    e.add_argument("-o", "--output", help="write to this file instead of stdout")
    e.add_argument(
        "--jwt-issuer", help="verify JWTs from this issuer with jwt_authn (docs/identity.md)"
    )
    e.add_argument("--jwks-file", help="local JWKS file for --jwt-issuer")
    e.add_argument("--jwt-audience", action="append", help="accepted audience (repeatable)")
    e.add_argument(
        "--jwt-required",
        action="store_true",
        help="refuse requests without a valid token in Envoy (default: API keys still work)",
    )
    e.add_argument(
        "--trusted-header",
        action="append",
        help="an identity header only Envoy's own filters may set (identity.header in the rules): "
        "removed from client requests first (repeatable; default x-authenticated-tenant and "
        "x-authenticated-user)",
    )
    _add_auth_flags(e)


def _add_auth_flags(e: argparse.ArgumentParser) -> None:
    """How Envoy authenticates to the processors (docs/security.md)."""
    e.add_argument(
        "--extproc-token-file",
        help="send the first token of this file as 'authorization: Bearer' initial_metadata "
        "on the ext_proc grpc_service (the processors' --grpc-token-file)",
    )
    e.add_argument(
        "--extproc-ca",
        help="talk TLS to the processors and verify their certificate with this CA (PEM)",
    )
    e.add_argument("--extproc-client-cert", help="Envoy's client certificate (mutual TLS, PEM)")
    e.add_argument("--extproc-client-key", help="Envoy's client key (mutual TLS, PEM)")
    e.add_argument(
        "--extproc-server-name",
        default="ai-quota",
        help="SNI, and the DNS SAN the processors' certificate must hold (default ai-quota)",
    )


def auth_from(args: argparse.Namespace) -> GrpcClientAuth | None:
    """The :class:`GrpcClientAuth` the flags describe (None: plaintext, no credential)."""
    from extproc.access import parse_tokens
    from extproc.envoy_config import GrpcClientAuth

    token = ""
    if args.extproc_token_file:
        tokens = parse_tokens(Path(args.extproc_token_file).read_text(encoding="utf-8"))
        if not tokens:
            raise ValueError(f"{args.extproc_token_file} holds no token")
        token = tokens[0]
    if bool(args.extproc_client_cert) != bool(args.extproc_client_key):
        raise ValueError("--extproc-client-cert and --extproc-client-key go together")
    if args.extproc_client_cert and not args.extproc_ca:
        raise ValueError("--extproc-client-cert needs --extproc-ca (mutual TLS is TLS)")
    if not (token or args.extproc_ca):
        return None
    return GrpcClientAuth(
        token=token,
        ca_file=args.extproc_ca or "",
        cert_file=args.extproc_client_cert or "",
        key_file=args.extproc_client_key or "",
        server_name=args.extproc_server_name,
    )


def _addresses(values: list[str]) -> tuple[tuple[str, int], ...]:
    """``host:port`` flags as (host, port) pairs (the host defaults to loopback)."""
    out = []
    for v in values:
        host, _, port = v.rpartition(":")
        out.append((host or "127.0.0.1", int(port)))
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    """Print an Envoy bootstrap for the given ports."""
    import os

    from extproc.envoy_config import (
        DEFAULT_TRUSTED_HEADERS,
        EnvoyPorts,
        EnvoyTracing,
        JwtAuth,
        header,
        render_yaml,
    )

    try:
        auth = auth_from(args)
        # the processors' OTEL_* variables: Envoy's tracer goes to the same collector
        tracing = EnvoyTracing.from_env(os.environ)
    except (OSError, ValueError) as exc:  # OtelConfigError is a ValueError
        print(f"ai-quota envoy-config: {exc}", file=sys.stderr)
        return 2
    if auth is None:
        print(
            "ai-quota envoy-config: no --extproc-token-file or --extproc-ca: Envoy will call "
            "the processors in plaintext without a credential (they must run --insecure)",
            file=sys.stderr,
        )
    ports = EnvoyPorts(
        listen_host=args.listen_host,
        listen_port=args.listen_port,
        admin_port=args.admin_port,
        upstreams=_addresses(args.upstream or ["127.0.0.1:18080"]),
        extprocs=_addresses(args.extproc or ["127.0.0.1:50051"]),
        max_body_bytes=args.max_body_bytes,
        trusted_headers=tuple(args.trusted_header or DEFAULT_TRUSTED_HEADERS),
        jwt=JwtAuth(
            issuer=args.jwt_issuer,
            jwks_path=args.jwks_file,
            audiences=tuple(args.jwt_audience or ()),
            required=args.jwt_required,
        )
        if args.jwt_issuer
        else None,
        extproc_auth=auth,
        tracing=tracing,
    )
    text = render_yaml(ports, header=header(ports))
    if args.jwt_issuer and not args.jwks_file:
        print("ai-quota envoy-config: --jwt-issuer needs --jwks-file", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
