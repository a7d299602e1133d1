"""``ai-quota serve``: run the ext_proc gRPC service (one process, or N supervised workers)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from extproc.commands import DEMO_CONFIG

if TYPE_CHECKING:
    from extproc.settings import Settings


def configure_parser(s: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota serve`` (each overrides its ``AIQ_*`` variable)."""
    s.add_argument("--config", help=f"rules file (env AIQ_CONFIG, default {DEMO_CONFIG})")
    s.add_argument(
        "--redis-url",
        help="redis://host:port/db, redis+cluster://host:port or "
        "redis+sentinel://host:port[,host:port...]/<master>[/db] (env AIQ_REDIS_URL)",
    )
    s.add_argument(
        "--grpc-address",
        help="host:port to listen on (env AIQ_GRPC_ADDRESS, default 127.0.0.1:50051)",
    )
    s.add_argument(
        "--log-format", choices=["json", "console"], help="log output (env AIQ_LOG_FORMAT)"
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on PORT (with --workers: merged over workers)",
    )
    s.add_argument(
        "--metrics-host",
        help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 in a pod)",
    )
    s.add_argument(
        "--workers",
        type=int,
        help="N supervised worker processes: restarted when they die, SIGHUP/SIGTERM forwarded "
        "(env AIQ_WORKERS); they share the port with SO_REUSEPORT unless --port-per-worker",
    )
    s.add_argument(
        "--port-per-worker",
        action="store_true",
        help="with --workers N: worker i listens on PORT+i (list each as an Envoy endpoint)",
    )
    s.add_argument(
        "--admin-port",
        type=int,
        help="serve the admin API (tenants, keys: docs/admin.md) on this port (env "
        "AIQ_ADMIN_PORT, default 0: off)",
    )
    s.add_argument(
        "--admin-host", help="address of the admin API (env AIQ_ADMIN_HOST, default 127.0.0.1)"
    )
    s.add_argument(
        "--admin-token-file",
        help="bearer token of the admin API (env AIQ_ADMIN_TOKEN_FILE; required off loopback)",
    )
    s.add_argument("--admin-tls-cert", help="TLS certificate of the admin API (PEM)")
    s.add_argument("--admin-tls-key", help="TLS private key of the admin API (PEM)")
    s.add_argument(
        "--admin-tls-client-ca",
        help="require client certificates signed by this CA (PEM): mutual TLS "
        "(env AIQ_ADMIN_TLS_CLIENT_CA)",
    )
    s.add_argument(
        "--rls-config",
        help="envoyproxy/ratelimit config served by the RLS API: a YAML file or a directory "
        "of them, one per domain (env AIQ_RLS_CONFIG; docs/rls.md)",
    )
    s.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        help="serve the gRPC port without any caller credential (env AIQ_INSECURE=1): anyone "
        "who reaches it may call ext_proc, RLS and usage; logged as a warning (docs/security.md)",
    )
    s.add_argument(
        "--grpc-token-file",
        help="bearer tokens Envoy (ext_proc, RLS callers) must present, one per line: two "
        "during a rotation; re-read when it changes (env AIQ_GRPC_TOKEN_FILE)",
    )
    s.add_argument("--grpc-tls-cert", help="TLS certificate of the gRPC port (PEM; reloaded)")
    s.add_argument("--grpc-tls-key", help="TLS private key of the gRPC port (PEM; reloaded)")
    s.add_argument(
        "--grpc-tls-client-ca",
        help="require client certificates signed by this CA on the gRPC port: mutual TLS "
        "(env AIQ_GRPC_TLS_CLIENT_CA)",
    )
    s.add_argument(
        "--grpc-allowed-san",
        action="append",
        help="a SAN (DNS name, URI, ...) of a client certificate that may call ext_proc/RLS "
        "(repeatable; env AIQ_GRPC_ALLOWED_SANS, comma-separated; default: any the CA signed)",
    )
    s.add_argument(
        "--health-address",
        help="also serve grpc.health.v1 alone, in plaintext, on this host:port (env "
        "AIQ_HEALTH_ADDRESS): for probes that cannot speak TLS, e.g. the kubelet's",
    )
    s.add_argument(
        "--rls-address",
        help="serve the RLS API on its own host:port (env AIQ_RLS_ADDRESS; default: the "
        "ext_proc port)",
    )


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """The process settings of ``serve``: ``AIQ_*`` variables from ``env`` (default
    ``os.environ``), overridden by the flags given (also how the Kubernetes manifests' command
    lines and env are checked, tests/unit/test_deploy_kubernetes.py).  Raises
    :class:`extproc.settings.SettingsError`."""
    from extproc.settings import Settings

    return Settings.from_env(
        env,
        config=args.config,
        redis_url=args.redis_url,
        grpc_address=args.grpc_address,
        log_format=args.log_format,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        workers=args.workers,
        admin_port=args.admin_port,
        admin_host=args.admin_host,
        admin_token_file=args.admin_token_file,
        admin_tls_cert=args.admin_tls_cert,
        admin_tls_key=args.admin_tls_key,
        admin_tls_client_ca=args.admin_tls_client_ca,
        rls_config=args.rls_config,
        rls_address=args.rls_address,
        insecure=args.insecure,
        health_address=args.health_address,
        grpc_token_file=args.grpc_token_file,
        grpc_tls_cert=args.grpc_tls_cert,
        grpc_tls_key=args.grpc_tls_key,
        grpc_tls_client_ca=args.grpc_tls_client_ca,
        grpc_allowed_sans=",".join(args.grpc_allowed_san) if args.grpc_allowed_san else None,
    )


def run(args: argparse.Namespace) -> int:
    """Run the ext_proc gRPC server."""
    from extproc.access import AccessConfigError
    from extproc.admin.errors import AdminConfigError
    from extproc.app import serve_forever
    from extproc.config import ConfigError
    from extproc.limiter.redis_url import RedisUrlError
    from extproc.logs import configure_logging
    from extproc.ports import ListenError
    from extproc.rls.config import RlsConfigError
    from extproc.settings import SettingsError
    from extproc.telemetry import OtelConfigError
    from extproc.telemetry import check_env as check_telemetry_env

    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"ai-quota serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    try:  # refuse a port left open by accident before anything starts (workers included)
        check_security(settings)
    except AccessConfigError as exc:
        print(f"ai-quota serve: {exc}", file=sys.stderr)
        return 2
    try:  # the OTEL_* variables (docs/observability.md), before anything starts
        check_telemetry_env()
    except OtelConfigError as exc:
        print(f"ai-quota serve: OpenTelemetry: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        try:
            return _serve_workers(settings, port_per_worker=bool(args.port_per_worker))
        except ListenError as exc:  # the parent's metrics port
            print(f"ai-quota serve: {exc}", file=sys.stderr)
            return 2
    if settings.event_loop == "uvloop":
        _use_uvloop()
    try:
        return asyncio.run(serve_forever(settings))
    except ConfigError as exc:
        print(f"ai-quota serve: invalid config\n{exc}", file=sys.stderr)
        return 1
    except RlsConfigError as exc:
        print(f"ai-quota serve: invalid RLS config\n{exc}", file=sys.stderr)
        return 1
    except ListenError as exc:  # a port in use: one line naming it
        print(f"ai-quota serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ai-quota serve: {exc}", file=sys.stderr)
        return 1
    except (AdminConfigError, AccessConfigError) as exc:
        print(f"ai-quota serve: {exc}", file=sys.stderr)
        return 2
    except RedisUrlError as exc:  # a Sentinel master name no sentinel knows
        print(f"ai-quota serve: AIQ_REDIS_URL: {exc}", file=sys.stderr)
        return 2


def check_security(settings: Any) -> None:
    """The gRPC port's settings (extproc.access.check_settings), from process settings."""
    from extproc.access import check_settings

    check_settings(
        address=settings.grpc_address,
        insecure=settings.insecure,
        token_file=settings.grpc_token_file,
        tls_cert=settings.grpc_tls_cert,
        tls_key=settings.grpc_tls_key,
        client_ca=settings.grpc_tls_client_ca,
        allowed_sans=settings.allowed_sans,
        allow_plaintext=settings.grpc_allow_plaintext,
        rls_address=settings.rls_address if settings.rls_config else "",
    )


def _use_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def _serve_workers(settings: Any, *, port_per_worker: bool = False) -> int:
    """N supervised worker processes (see :mod:`extproc.supervisor`)."""
    from extproc.supervisor import Supervisor

    return Supervisor(settings, port_per_worker=port_per_worker).run()
