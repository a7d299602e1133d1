"""``ai-quota usage``: ask a running ext_proc service where a tenant stands."""

from __future__ import annotations

import argparse
import sys

import grpc
import orjson

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.core.admission_plan import human_duration
from extproc.usage.discover import note, port_credentials, usage_address
from extproc.usage.records_cli import add_subcommands


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota usage`` (and its ``export`` / ``consume`` subcommands)."""
    who = parser.add_mutually_exclusive_group()  # one is required unless a subcommand is given
    who.add_argument("--key", help="an API key (sent to the service, never logged)")
    who.add_argument("--tenant", help="a tenant id")
    parser.add_argument("--model", default="", help="only buckets that apply to this model")
    parser.add_argument(
        "--organisation",
        default="",
        help="an organisation: its buckets and its teams' (the admin token, or a key in it)",
    )
    parser.add_argument(
        "--team",
        default="",
        help="a team: its buckets and its organisation's (with --key: the key's)",
    )
    parser.add_argument(
        "--end-user", default="", help="with --team or --key: that end user's buckets in the team"
    )
    parser.add_argument(
        "--address",
        help="ext_proc gRPC address (default: $AIQ_USAGE_ADDRESS or $AIQ_GRPC_ADDRESS, else the "
        "running stack's .run/stack.json, else 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--ca-file",
        help="TLS: verify the service with this CA (env AIQ_USAGE_CA_FILE; default: the "
        "running stack's, else plaintext)",
    )
    parser.add_argument(
        "--token-file",
        help="bearer token: the admin token reads any tenant (env AIQ_USAGE_TOKEN_FILE; "
        "default: the running stack's admin token; with --key, the key is the credential)",
    )
    parser.add_argument(
        "--server-name", help="the name in the service's certificate (default: its address)"
    )
    parser.add_argument("--cert-file", help="a client certificate (a port with mutual TLS)")
    parser.add_argument("--key-file", help="the client certificate's key")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_subcommands(parser)
    parser.set_defaults(usage_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Query the usage service and print the buckets (or run ``export`` / ``consume``)."""
    if getattr(args, "usage_run", None) is not None:
        return int(args.usage_run(args))
    if not (args.key or args.tenant or args.organisation or args.team):
        args.usage_parser.error(
            "one of the arguments --key --tenant --organisation --team is required"
        )
    address = usage_address(args.address)
    note("ai-quota usage", address)
    door = port_credentials(
        address,
        ca_file=args.ca_file,
        token_file=args.token_file,
        server_name=args.server_name,
        cert_file=args.cert_file,
        key_file=args.key_file,
    )
    try:
        token = door.token() or args.key or ""
        channel = door.channel(address.value)
    except OSError as exc:
        print(f"ai-quota usage: {exc}", file=sys.stderr)
        return 1
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with channel as ch:
        stub = usage_pb2_grpc.UsageStub(ch)
        try:
            resp = stub.GetUsage(
                usage_pb2.GetUsageRequest(
                    api_key=args.key or "",
                    tenant=args.tenant or "",
                    model=args.model,
                    organisation=args.organisation,
                    team=args.team,
                    end_user=args.end_user,
                ),
                metadata=metadata,
                timeout=5,
            )
        except grpc.RpcError as exc:
            print(
                f"ai-quota usage: {address.value}: {exc.code().name}: {exc.details()}",
                file=sys.stderr,
            )
            return 1
    rows = [
        {
            "metric": b.metric,
            "model": b.model,
            "scope": b.scope,
            "level": b.level,
            "period": b.period,
            "window_s": b.window_seconds,
            "unit": b.unit,
            "limit": b.limit,
            "used": b.used,
            "remaining": b.remaining,
            "limit_display": b.limit_display or str(b.limit),
            "used_display": b.used_display or str(b.used),
            "reset_s": round(b.reset_seconds, 1),
            "shadow": b.shadow,
            "sliding": b.sliding,
        }
        for b in resp.buckets
    ]
    if args.json:
        sys.stdout.write(
            orjson.dumps(
                {
                    "tenant": resp.tenant,
                    "plan": resp.plan,
                    "key": resp.key_name,
                    "organisation": resp.organisation,
                    "team": resp.team,
                    "config_version": resp.config_version,
                    "buckets": rows,
                },
                option=orjson.OPT_INDENT_2,
            ).decode()
            + "\n"
        )
        return 0
    print(
        (f"tenant {resp.tenant}  plan {resp.plan}" if resp.tenant else "")
        + (f"  key {resp.key_name}" if resp.key_name else "")
        + (f"  organisation {resp.organisation}" if resp.organisation else "")
        + (f"  team {resp.team}" if resp.team else "")
        + (f"  rules {resp.config_version}" if resp.config_version else "")
    )
    print(
        f"{'metric':11} {'model':14} {'level':24} {'per':>8} {'unit':>8} {'used':>12} "
        f"{'limit':>12} {'resets in':>10}  notes"
    )
    for r in rows:
        notes = " ".join(n for n in ("shadow", "sliding") if r[n])
        per = r["period"] or "-"
        # under a minute with its tenth (a window about to turn), else as people read it
        secs = float(r["reset_s"])
        reset = (f"{secs}s" if secs < 60 else human_duration(secs)) if r["period"] else "-"
        print(
            f"{r['metric']:11} {r['model']:14} {r['level'] or r['scope']:24} {per:>8} {r['unit']:>8} "
            f"{r['used_display']:>12} {r['limit_display']:>12} {reset:>10}  {notes}"
        )
    return 0
