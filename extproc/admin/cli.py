"""``ai-quota admin``: change tenants and keys through a replica's admin API; prints JSON.

    ai-quota admin create-key --tenant acme --name ci --token-file admin.token
    ai-quota admin rotate-key key_0123456789abcdef --grace 300
    ai-quota admin revoke-key key_0123456789abcdef
    ai-quota admin set-key-team key_0123456789abcdef --team research
    ai-quota admin set-tenant --tenant acme --plan standard --limit '{per: minute, rpm: 10}'
    ai-quota admin delete-tenant --tenant acme
    ai-quota admin list | get --tenant acme | version
    ai-quota admin audit --since-version 40

The address defaults to ``AIQ_ADMIN_ADDRESS`` (else ``127.0.0.1:50052``), the token file to
``AIQ_ADMIN_TOKEN_FILE``; ``--tls-cert``/``--tls-key`` present a client certificate (mutual
TLS).  ``--actor`` (default ``$AIQ_ADMIN_ACTOR``, else ``$USER``) is recorded in the audit log
as who the call was made for.  A new or rotated key's plaintext is printed once (``api_key``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import grpc
import orjson
import yaml
from google.protobuf import json_format

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50052"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The ``admin`` subcommands and the connection flags each takes."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        default=os.environ.get("AIQ_ADMIN_ADDRESS", DEFAULT_ADDRESS),
        help="the admin API (env AIQ_ADMIN_ADDRESS, default %(default)s)",
    )
    common.add_argument(
        "--token-file",
        default=os.environ.get("AIQ_ADMIN_TOKEN_FILE", ""),
        help="file holding the bearer token (env AIQ_ADMIN_TOKEN_FILE)",
    )
    common.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    common.add_argument("--tls-ca", help="connect with TLS, trusting this CA certificate (PEM)")
    common.add_argument("--tls-cert", help="client certificate for mutual TLS (PEM)")
    common.add_argument("--tls-key", help="the client certificate's private key (PEM)")
    common.add_argument(
        "--actor",
        default=os.environ.get("AIQ_ADMIN_ACTOR") or os.environ.get("USER", ""),
        help="who the change is made for, recorded in the audit log "
        "(env AIQ_ADMIN_ACTOR, else $USER)",
    )
    common.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    sub = parser.add_subparsers(dest="admin_command", required=True, metavar="ACTION")

    p = sub.add_parser("create-key", parents=[common], help="a new API key (printed once)")
    p.add_argument("--tenant", required=True)
    p.add_argument("--name", required=True, help="the key's name (logs, per-key limits)")
    p.add_argument("--team", default="", help="the key's team (default: its tenant's)")
    p.set_defaults(admin_call=_create_key)

    p = sub.add_parser("rotate-key", parents=[common], help="a new secret for a key")
    p.add_argument("key_id")
    p.add_argument(
        "--grace",
        type=float,
        default=0.0,
        help="seconds the old secret keeps working (default 0: revoked now)",
    )
    p.set_defaults(admin_call=_rotate_key)

    p = sub.add_parser("revoke-key", parents=[common], help="revoke a key on every replica")
    p.add_argument("key_id")
    p.set_defaults(admin_call=_revoke_key)

    p = sub.add_parser("set-key-team", parents=[common], help="move a key to another team")
    p.add_argument("key_id")
    p.add_argument("--team", default="", help="its new team (default: its tenant's)")
    p.set_defaults(admin_call=_set_key_team)

    p = sub.add_parser(
        "set-tenant", parents=[common], help="create a tenant or replace its plan and limits"
    )
    p.add_argument("--tenant", required=True)
    p.add_argument("--plan", required=True, help="a plan of the rules file")
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        help="a limit entry as in the rules file, JSON or YAML flow style (repeatable)",
    )
    p.add_argument("--limits-file", help="a YAML file holding a list of limit entries")
    p.add_argument("--organisation", default="", help="the tenant's organisation")
    p.add_argument("--team", default="", help="the tenant's team (of its organisation)")
    p.set_defaults(admin_call=_set_tenant)

    for kind in ("organisation", "team"):
        p = sub.add_parser(
            f"set-{kind}",
            parents=[common],
            help=f"create an {kind} or replace its limits"
            if kind == "organisation"
            else "create a team or replace its limits and end-user limits",
        )
        p.add_argument("--name", required=True)
        if kind == "team":
            p.add_argument("--organisation", required=True)
            p.add_argument(
                "--end-user-limit",
                action="append",
                default=[],
                help="each end user's limit (a limit entry, repeatable)",
            )
            p.add_argument("--max-end-users", type=int, default=0, help="per window (0: 10000)")
            p.add_argument("--end-user-window", default="", help="that cap's window (minute)")
        p.add_argument("--limit", action="append", default=[], help="a limit entry (repeatable)")
        p.add_argument("--strict", action="store_true", help="strict streaming for all in it")
        p.set_defaults(admin_call=_set_level, level_kind=kind)
        p = sub.add_parser(f"delete-{kind}", parents=[common], help=f"remove a stored {kind}")
        p.add_argument("--name", required=True)
        p.set_defaults(
            admin_call=lambda stub, a, md, t: stub.DeleteLevel(
                admin_pb2.DeleteLevelRequest(kind=a.level_kind, name=a.name),
                metadata=md,
                timeout=t,
            ),
            level_kind=kind,
        )
    p = sub.add_parser("levels", parents=[common], help="every organisation and team")
    p.set_defaults(
        admin_call=lambda stub, _a, md, t: stub.ListLevels(
            admin_pb2.ListLevelsRequest(), metadata=md, timeout=t
        )
    )

    p = sub.add_parser("delete-tenant", parents=[common], help="remove a tenant from the store")
    p.add_argument("--tenant", required=True)
    p.set_defaults(admin_call=_delete_tenant)

    p = sub.add_parser("list", parents=[common], help="every tenant (file and store)")
    p.set_defaults(
        admin_call=lambda stub, _a, md, t: stub.ListTenants(
            admin_pb2.ListTenantsRequest(), metadata=md, timeout=t
        )
    )

    p = sub.add_parser("get", parents=[common], help="one tenant: plan, limits, key names")
    p.add_argument("--tenant", required=True)
    p.set_defaults(
        admin_call=lambda stub, a, md, t: stub.GetTenant(
            admin_pb2.GetTenantRequest(tenant=a.tenant), metadata=md, timeout=t
        )
    )

    p = sub.add_parser("audit", parents=[common], help="the audit log: who changed what")
    p.add_argument(
        "--since-version", type=int, default=0, help="only changes after this store version"
    )
    p.add_argument("--limit", type=int, default=100, help="the newest N (default 100, max 1000)")
    p.set_defaults(
        admin_call=lambda stub, a, md, t: stub.ListChanges(
            admin_pb2.ListChangesRequest(since_version=a.since_version, limit=a.limit),
            metadata=md,
            timeout=t,
        )
    )

    p = sub.add_parser("version", parents=[common], help="store and rules versions")
    p.set_defaults(
        admin_call=lambda stub, _a, md, t: stub.GetVersion(
            admin_pb2.GetVersionRequest(), metadata=md, timeout=t
        )
    )


class UsageError(ValueError):
    """A flag's value cannot be sent."""


def _create_key(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    return stub.CreateKey(
        admin_pb2.CreateKeyRequest(tenant=a.tenant, name=a.name, team=a.team),
        metadata=md,
        timeout=t,
    )


def _entries(texts: list[str]) -> list[Any]:
    out: list[Any] = []
    for text in texts:
        try:
            out.append(limit_message(yaml.safe_load(text)))
        except yaml.YAMLError as exc:
            raise UsageError(f"--limit {text!r}: not JSON or YAML: {exc}") from exc
    return out


def _set_level(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    team = a.level_kind == "team"
    req = admin_pb2.SetLevelRequest(
        kind=a.level_kind,
        name=a.name,
        organisation=a.organisation if team else "",
        limits=_entries(a.limit),
        end_user_limits=_entries(a.end_user_limit) if team else [],
        max_end_users=a.max_end_users if team else 0,
        end_user_window=a.end_user_window if team else "",
        strict=a.strict,
    )
    return stub.SetLevel(req, metadata=md, timeout=t)


def _rotate_key(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    return stub.RotateKey(
        admin_pb2.RotateKeyRequest(key_id=a.key_id, grace_seconds=a.grace), metadata=md, timeout=t
    )


def _revoke_key(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    return stub.RevokeKey(admin_pb2.RevokeKeyRequest(key_id=a.key_id), metadata=md, timeout=t)


def _set_key_team(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    req = admin_pb2.SetKeyTeamRequest(key_id=a.key_id, team=a.team)
    return stub.SetKeyTeam(req, metadata=md, timeout=t)


def _delete_tenant(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    return stub.DeleteTenant(admin_pb2.DeleteTenantRequest(tenant=a.tenant), metadata=md, timeout=t)


def _set_tenant(stub: Any, a: argparse.Namespace, md: Any, t: float) -> Any:
    entries: list[Any] = []
    if a.limits_file:
        loaded = yaml.safe_load(Path(a.limits_file).read_text(encoding="utf-8"))
        if not isinstance(loaded, list):
            raise UsageError(f"{a.limits_file}: expected a list of limit entries")
        entries.extend(loaded)
    for text in a.limit:
        try:
            entries.append(yaml.safe_load(text))
        except yaml.YAMLError as exc:
            raise UsageError(f"--limit {text!r}: not JSON or YAML: {exc}") from exc
    limits = [limit_message(e) for e in entries]
    return stub.SetTenant(
        admin_pb2.SetTenantRequest(
            tenant=a.tenant,
            plan=a.plan,
            limits=limits,
            organisation=a.organisation,
            team=a.team,
        ),
        metadata=md,
        timeout=t,
    )


def limit_message(entry: Any) -> Any:
    """A rules-file limit entry (a mapping) as an ``aiquota.v1.Limit``."""
    if not isinstance(entry, dict):
        raise UsageError(f"a limit entry must be a mapping, not {entry!r}")
    fields = dict(entry)
    weights = fields.pop("weights", None)
    try:
        msg = admin_pb2.Limit(**fields)
        if weights is not None:
            msg.weights.CopyFrom(admin_pb2.Weights(**weights))
    except (ValueError, TypeError) as exc:
        raise UsageError(f"limit entry {entry!r}: {exc}") from exc
    return msg


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls or args.tls_ca or args.tls_cert:
        root = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        key = Path(args.tls_key).read_bytes() if args.tls_key else None
        cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
        creds = grpc.ssl_channel_credentials(root, key, cert)
        return grpc.secure_channel(args.address, creds)
    return grpc.insecure_channel(args.address)


def _to_json(msg: Any) -> dict[str, Any]:
    try:
        out: dict[str, Any] = json_format.MessageToDict(
            msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    except TypeError:  # protobuf before 5.26 names the option differently
        out = json_format.MessageToDict(
            msg, preserving_proto_field_name=True, including_default_value_fields=True
        )
    return out


def run(args: argparse.Namespace) -> int:
    """Make the call and print its answer as JSON (errors: on stderr, exit 1)."""
    metadata: list[tuple[str, str]] = []
    try:
        if args.token_file:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
            metadata.append(("authorization", f"Bearer {token}"))
        if args.actor:
            metadata.append(("x-aiq-actor", args.actor))
        with _channel(args) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            resp = args.admin_call(stub, args, metadata, args.timeout)
    except grpc.RpcError as exc:
        print(f"ai-quota admin: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, UsageError) as exc:
        print(f"ai-quota admin: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(orjson.dumps(_to_json(resp), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0
