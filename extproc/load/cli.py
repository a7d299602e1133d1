"""``ai-quota load``: command-line front end of the load-test harness."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from extproc.load.config import (
    LoadConfig,
    LoadConfigError,
    parse_limit,
    parse_max_tokens,
    parse_weights,
)
from extproc.load.output import write_report
from extproc.load.runner import run_load
from extproc.load.tolerance import overshoot_violations, parse_tolerance
from extproc.load.validate import validate_report

EXIT_OK = 0
EXIT_OVERSHOOT = 1
EXIT_USAGE = 2
EXIT_HARNESS_ERROR = 3

DESCRIPTION = """\
Drive concurrent streaming and non-streaming OpenAI-compatible clients against the quota
gateway (or the simulator directly, as a no-gateway baseline), and write a report: outcomes
per tenant and model (ok / refused with 429 / cut mid-stream / failed), tokens delivered per
wall-clock-aligned window with overshoot against --limit-tpm, TTFT/ITL percentiles, and the
simulator's ground truth when --sim-url is given. Only loopback URLs may be targeted.
"""

EPILOG = """\
examples:
  ai-quota load --target http://127.0.0.1:10000/v1 --key sk-a --key sk-b \\
      --concurrency 32 --duration 120 --limit-tpm sk-a=20000 --sim-url http://127.0.0.1:18080
  ai-quota load --target http://127.0.0.1:18080/v1 --key sk-a --rate 20 --requests 500
"""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``load`` sub-command's options to ``parser``."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    tgt = parser.add_argument_group("targets and traffic mix")
    tgt.add_argument(
        "--target",
        action="append",
        metavar="URL",
        help="OpenAI-compatible base URL (loopback only), repeatable; requests "
        "are spread round-robin (default http://127.0.0.1:10000/v1)",
    )
    tgt.add_argument(
        "--key",
        action="append",
        metavar="KEY",
        help="API key sent as 'Authorization: Bearer KEY', repeatable; each key "
        "is a tenant in the report (default sk-test)",
    )
    tgt.add_argument(
        "--key-weights", metavar="W1,W2,...", help="relative share of requests per --key, e.g. 3,1"
    )
    tgt.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="model name, repeatable; chosen uniformly (default sim-small)",
    )
    tgt.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="POST /chat/completions or /completions (default chat)",
    )
    tgt.add_argument(
        "--stream-ratio",
        type=float,
        default=0.8,
        help="fraction of streaming requests (default 0.8)",
    )
    tgt.add_argument(
        "--max-tokens",
        default="128",
        metavar="N|LO:HI",
        help="max_tokens per request, or a uniform range (default 128)",
    )
    tgt.add_argument(
        "--prompt-tokens",
        type=int,
        default=64,
        help="approximate prompt size in cl100k tokens (default 64)",
    )
    tgt.add_argument(
        "--no-usage", action="store_true", help="do not ask for stream_options.include_usage"
    )
    tgt.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra request header, repeatable",
    )

    load = parser.add_argument_group("load shape and bounds")
    load.add_argument(
        "--concurrency", type=int, default=8, help="closed loop: number of workers (default 8)"
    )
    load.add_argument(
        "--rate", type=float, help="open loop: arrivals per second (switches to open loop)"
    )
    load.add_argument(
        "--arrival",
        choices=("poisson", "uniform"),
        default="poisson",
        help="open-loop arrival process (default poisson)",
    )
    load.add_argument(
        "--max-in-flight",
        type=int,
        default=256,
        help="open loop: cap on concurrent requests (default 256)",
    )
    load.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="stop starting requests after S seconds (default 10 when "
        "--requests is not given either)",
    )
    load.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="stop after N requests (whichever of --duration/--requests first)",
    )
    load.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="hard timeout per request (default 60)",
    )
    load.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    load.add_argument("--run-id", help="prefix of x-client-request-id (default generated)")

    rep = parser.add_argument_group("report")
    rep.add_argument(
        "--out", metavar="DIR", help="report directory (default ./load-report-<timestamp>)"
    )
    rep.add_argument("--no-plot", action="store_true", help="skip report.png")
    rep.add_argument(
        "--window-seconds",
        type=float,
        default=60.0,
        help="token window length, aligned to wall-clock multiples (default 60)",
    )
    rep.add_argument(
        "--limit-tpm",
        action="append",
        default=[],
        metavar="KEY=N",
        help="tokens-per-minute limit of a tenant, repeatable; enables overshoot "
        "and utilisation per window",
    )
    rep.add_argument(
        "--sim-url", metavar="URL", help="simulator base URL for ground truth (GET /sim/requests)"
    )
    rep.add_argument(
        "--fail-on-overshoot",
        action="store_true",
        help="exit 1 when any window's overshoot exceeds --overshoot-tolerance",
    )
    rep.add_argument(
        "--overshoot-tolerance",
        default="0",
        metavar="N|P%",
        help="allowed overshoot per window, tokens or percent of the limit (default 0)",
    )
    prog = rep.add_mutually_exclusive_group()
    prog.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="force the live progress line on stderr",
    )
    prog.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="disable the live progress line",
    )


def _headers(values: list[str]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for v in values:
        name, sep, value = v.partition(":")
        if not sep or not name.strip():
            raise LoadConfigError(f"--header must be NAME:VALUE, got {v!r}")
        out.append((name.strip(), value.strip()))
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Build and validate a ``LoadConfig`` from parsed arguments."""
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    return LoadConfig(
        targets=tuple(args.target or ("http://127.0.0.1:10000/v1",)),
        keys=tuple(args.key or ("sk-test",)),
        key_weights=parse_weights(args.key_weights) if args.key_weights else None,
        models=tuple(args.model or ("sim-small",)),
        endpoint=args.endpoint,
        stream_ratio=args.stream_ratio,
        max_tokens=parse_max_tokens(args.max_tokens),
        prompt_tokens=args.prompt_tokens,
        concurrency=args.concurrency,
        rate=args.rate,
        arrival=args.arrival,
        max_in_flight=args.max_in_flight,
        duration=args.duration,
        requests=args.requests,
        request_timeout=args.request_timeout,
        window_seconds=args.window_seconds,
        limits_tpm=tuple(parse_limit(x) for x in args.limit_tpm),
        sim_url=args.sim_url,
        include_usage=not args.no_usage,
        seed=args.seed,
        run_id=args.run_id,
        progress=bool(progress),
        extra_headers=_headers(args.header),
    ).validated()


def run(args: argparse.Namespace) -> int:
    """Run the load test; 0 when it completed (429s included), non-zero on harness errors."""
    try:
        config = config_from_args(args)
        parse_tolerance(args.overshoot_tolerance)
    except (LoadConfigError, ValueError) as exc:
        print(f"ai-quota load: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = asyncio.run(run_load(config))
    except KeyboardInterrupt:
        print("ai-quota load: interrupted", file=sys.stderr)
        return EXIT_HARNESS_ERROR
    out_dir = Path(args.out or f"load-report-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        paths = write_report(report, out_dir, plot=not args.no_plot)
    except OSError as exc:
        print(f"ai-quota load: cannot write report: {exc}", file=sys.stderr)
        return EXIT_HARNESS_ERROR
    print(report.summary_text())
    print("report: " + ", ".join(str(p) for p in paths))
    problems = validate_report(report.data)
    if problems:
        for p in problems:
            print(f"ai-quota load: inconsistent report: {p}", file=sys.stderr)
        return EXIT_HARNESS_ERROR
    if args.fail_on_overshoot:
        violations = overshoot_violations(report.data, args.overshoot_tolerance)
        if violations:
            for v in violations:
                print(f"overshoot: {v}", file=sys.stderr)
            return EXIT_OVERSHOOT
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m extproc.load``)."""
    parser = argparse.ArgumentParser(prog="ai-quota load")
    configure_parser(parser)
    return run(parser.parse_args(argv))
