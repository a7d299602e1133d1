"""The ``export`` and ``consume`` subcommands of ``ai-quota usage``: their flags, where the
records are (:mod:`extproc.usage.discover`), and running the readers of
:mod:`extproc.records.export` with the output on stdout or a file.
"""

from __future__ import annotations

import argparse
import os
import sys

import redis.exceptions

from extproc.records.export import (
    Batch,
    consume_batches,
    export,
    jsonl_line,
    parse_time,
    sync_client,
)
from extproc.usage.discover import note, redis_url


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis URL (default $AIQ_REDIS_URL, else the running stack's .run/stack.json, "
        "else redis://127.0.0.1:6379/0)",
    )
    p.add_argument(
        "--stream", default=None, help="stream key (default $AIQ_USAGE_STREAM, else aiq:usage)"
    )


def configure_export_parser(p: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota usage export``."""
    _common(p)
    p.add_argument("--since", help="from this time, inclusive (ISO 8601 or unix seconds)")
    p.add_argument("--until", help="to this time, exclusive (ISO 8601 or unix seconds)")
    p.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    p.add_argument("--out", help="write to this file instead of stdout")


def configure_consume_parser(p: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota usage consume``."""
    _common(p)
    p.add_argument("--group", required=True, help="consumer group (created at the stream's start)")
    p.add_argument("--consumer", required=True, help="this reader's name, stable across restarts")
    p.add_argument("--count", type=int, default=100, help="records per read")
    p.add_argument("--block-ms", type=int, default=5000, help="wait for new records this long")
    p.add_argument(
        "--claim-idle-ms",
        type=int,
        default=60_000,
        help="take over records other consumers left unacknowledged this long (0: never)",
    )
    p.add_argument("--max", type=int, default=None, help="stop after this many records")
    p.add_argument(
        "--exit-when-idle", action="store_true", help="stop when a read finds nothing new"
    )


def target(args: argparse.Namespace) -> tuple[str, str]:
    """The Redis URL (flag, ``AIQ_REDIS_URL``, the running stack's, the default; said on stderr
    when it came from a stack.json) and the stream key of an ``export`` / ``consume`` run."""
    found = redis_url(args.redis_url)
    note(f"ai-quota usage {getattr(args, 'usage_command', None) or 'export'}", found)
    url = found.value
    stream = args.stream or os.environ.get("AIQ_USAGE_STREAM") or "aiq:usage"
    return url, stream


def run_export(args: argparse.Namespace) -> int:
    """``ai-quota usage export``."""
    try:
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until) if args.until else None
    except ValueError as exc:
        print(f"ai-quota usage export: {exc}", file=sys.stderr)
        return 2
    url, stream = target(args)
    client = sync_client(url)
    try:
        if args.out:
            with open(args.out, "w", encoding="utf-8", newline="") as f:
                n = export(client, stream, f, since_ms=since, until_ms=until, fmt=args.format)
        else:
            n = export(client, stream, sys.stdout, since_ms=since, until_ms=until, fmt=args.format)
    except redis.exceptions.RedisError as exc:
        print(f"ai-quota usage export: {stream} at {url}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"{n} records", file=sys.stderr)
    return 0


def run_consume(args: argparse.Namespace) -> int:
    """``ai-quota usage consume``: JSONL on stdout, each record acknowledged after its line was
    flushed."""
    url, stream = target(args)
    client = sync_client(url)
    out = sys.stdout

    def handle(batch: Batch) -> None:
        out.write("".join(jsonl_line(i, r) for i, r in batch))
        out.flush()

    try:
        consume_batches(
            client,
            stream,
            args.group,
            args.consumer,
            handle,
            count=args.count,
            block_ms=args.block_ms,
            claim_idle_ms=args.claim_idle_ms,
            max_records=args.max,
            exit_when_idle=args.exit_when_idle,
        )
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return 1
    except redis.exceptions.RedisError as exc:
        print(f"ai-quota usage consume: {stream} at {url}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    """Add ``export`` and ``consume`` under ``ai-quota usage`` (``args.usage_run`` runs the one
    given; without one, ``ai-quota usage --key/--tenant`` works as before)."""
    sub = parser.add_subparsers(dest="usage_command", metavar="{export,consume}")
    ex = sub.add_parser(
        "export",
        help="print the usage records of a time range (JSONL or CSV)",
        description="Usage records appended in [--since, --until), from the Redis Stream.",
    )
    configure_export_parser(ex)
    ex.set_defaults(usage_run=run_export)
    co = sub.add_parser(
        "consume",
        help="read usage records as a consumer group member (JSONL, acknowledged once written)",
        description="A consumer-group reader: each record is printed as a JSON line, flushed, "
        "then acknowledged (XACK); unacknowledged records are delivered again.",
    )
    configure_consume_parser(co)
    co.set_defaults(usage_run=run_consume)
