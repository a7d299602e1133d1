"""Command line of the benchmark suite (``scripts/bench``, ``python -m extproc.bench``)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from extproc.bench import runner
from extproc.bench.plan import Bench, BenchPlan
from extproc.bench.report import Table, document, render_docs
from extproc.bench.scenarios import SECTIONS


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota bench``."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer rounds and requests: about one minute instead of a few",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections (repeatable): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--skip",
        action="append",
        choices=SECTIONS,
        metavar="SECTION",
        help="leave these sections out (repeatable)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="A/B rounds per comparison (default 5, --quick 3)"
    )
    parser.add_argument(
        "--out",
        default="bench-results",
        help="directory for bench-<timestamp>.json (default bench-results)",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="soak for ten minutes instead of one (--quick: 20 s)",
    )
    parser.add_argument(
        "--render-docs",
        metavar="RESULTS_JSON",
        help="run nothing: rewrite the generated table of docs/performance.md from this JSON",
    )
    parser.add_argument(
        "--docs",
        default="docs/performance.md",
        help="the document --render-docs rewrites (default docs/performance.md)",
    )
    parser.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep the stacks' logs and configs (printed at the end)",
    )


def meta(
    plan: BenchPlan, sections: frozenset[str], started: float, elapsed: float
) -> dict[str, Any]:
    """Where and how the run happened."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    return {
        "started_at": dt.datetime.fromtimestamp(started, dt.UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 1),
        "cpus": os.cpu_count(),
        "loadavg_at_end": load,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "plan": plan.__dict__,
        "sections": sorted(sections),
    }


def run(args: argparse.Namespace) -> int:
    """Run the suite; print the table; write the JSON."""
    if args.render_docs:
        src = Path(args.render_docs)
        doc_path = Path(args.docs)
        doc_path.write_text(
            render_docs(orjson.loads(src.read_bytes()), doc_path.read_text(), src.as_posix())
        )
        print(f"rewrote the bench table of {doc_path} from {src}")
        return 0
    plan = BenchPlan.quick() if args.quick else BenchPlan()
    if args.rounds:
        plan = BenchPlan(**{**plan.__dict__, "rounds": args.rounds})
    if args.long:
        plan = BenchPlan(**{**plan.__dict__, "soak_seconds": 600.0})
    sections = frozenset(args.only or SECTIONS) - frozenset(args.skip or ())
    workdir = runner.new_workdir()
    bench = Bench(plan=plan, workdir=workdir, sections=sections)
    started = time.time()
    t0 = time.perf_counter()
    try:
        asyncio.run(runner.run(bench))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    doc = document(bench.table, meta(plan, sections, started, elapsed), bench.raw)
    path = write(doc, Path(args.out), started)
    print(summary(bench.table, doc["meta"]))
    print(f"\nwritten: {path}" + (f"\nworkdir: {workdir}" if args.keep_workdir else ""))
    return 0


def summary(table: Table, m: dict[str, Any]) -> str:
    """The console summary: a header line, the table, the target count."""
    met, missed = table.targets()
    head = (
        f"ai-quota bench {m['started_at']} — {m['cpus']} CPUs, {m['elapsed_s']} s, "
        f"Python {m['python']}"
    )
    return f"{head}\n\n{table.markdown()}\n\ntargets: {met} met, {missed} missed"


def write(doc: dict[str, Any], out: Path, started: float) -> Path:
    """Write ``bench-<timestamp>.json`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.fromtimestamp(started, dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"bench-{stamp}.json"
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m extproc.bench``."""
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Measure the gateway against same-run baselines (no-filter listener, "
        "do-nothing processor) and write bench-results/bench-<timestamp>.json.",
    )
    configure_parser(parser)
    return run(parser.parse_args(argv))
