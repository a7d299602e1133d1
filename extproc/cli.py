"""The ``ai-quota`` command: wires the sub-commands, each a module with ``configure_parser`` and
``run`` (the service's own under :mod:`extproc.commands`, the side tools' in their package's
``cli.py``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One sub-command: its name, the module that configures and runs it, its help texts."""

    name: str
    module: str
    help: str
    description: str | None = None
    #: a side tool: when its optional dependencies are missing, the command says so when run
    #: (with the extra that installs them) instead of breaking the whole command line
    optional: bool = False
    extra: str | None = None


COMMANDS: tuple[Command, ...] = (
    Command(
        "serve",
        "extproc.commands.serve",
        "run the ext_proc gRPC service",
        "Run the ext_proc gRPC service Envoy calls for every request. "
        "Settings come from AIQ_* environment variables; flags win.",
    ),
    Command(
        "up",
        "extproc.commands.up",
        "run the whole local stack (what scripts/run calls)",
        "Start Redis, the upstream simulator, the ext_proc service and Envoy "
        "on loopback, in the foreground. Ctrl-C stops everything.",
    ),
    Command(
        "check-config",
        "extproc.commands.check_config",
        "validate a rules file (exit 0 valid / 1 invalid)",
        "Validate a rules file strictly; every error names the file and the path.",
    ),
    Command(
        "envoy-config",
        "extproc.commands.envoy_config",
        "print an Envoy bootstrap with the ext_proc filter",
    ),
    Command(
        "sim",
        "extproc.sim.cli",
        "run the OpenAI-compatible upstream simulator",
        "An OpenAI-compatible model server simulator with ground-truth token records.",
        optional=True,
        extra="sim",
    ),
    Command(
        "load",
        "extproc.load.cli",
        "drive load at one or more OpenAI-compatible endpoints and report",
        "Load-test harness: concurrent streaming/non-streaming clients, report and plot.",
        optional=True,
        extra="load",
    ),
    Command(
        "bench",
        "extproc.bench.cli",
        "run the benchmark suite (what scripts/bench calls)",
        "Benchmarks against baselines measured in the same run: a table and JSON.",
        optional=True,
        extra="bench",
    ),
    Command(
        "usage",
        "extproc.usage.cli",
        "show where a tenant stands (current windows, limits, resets)",
        "Ask the running ext_proc service for a tenant's current counters.",
        optional=True,
    ),
    Command(
        "admin",
        "extproc.admin.cli",
        "create, rotate and revoke keys; set and delete tenants (the admin API)",
        "Change tenants and keys at run time through a replica's admin API "
        "(ai-quota serve --admin-port); prints JSON.",
        optional=True,
    ),
)


def _wire(command: Command, parser: argparse.ArgumentParser) -> None:
    """Let the command's module configure its parser and run it."""
    try:
        mod = importlib.import_module(command.module)
    except ImportError as exc:
        if not command.optional:
            raise
        err = exc
        parser.set_defaults(func=lambda _a: _missing(command, err))
        return
    mod.configure_parser(parser)
    parser.set_defaults(func=mod.run)


def _missing(command: Command, exc: Exception) -> int:
    hint = f" (pip install 'ai-quota[{command.extra}]')" if command.extra else ""
    print(f"ai-quota: {command.module} is unavailable: {exc}{hint}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    p = argparse.ArgumentParser(
        prog="ai-quota",
        description="Token-aware RPM/TPM quota gateway for LLM traffic (Envoy ext_proc + Redis).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        parser = sub.add_parser(command.name, help=command.help, description=command.description)
        _wire(command, parser)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ai-quota`` console script."""
    args = build_parser().parse_args(argv)
    if args.command not in ("serve", "sim"):
        # Side tools log to stderr so their stdout (reports, tables, YAML) stays clean.
        from extproc.logs import configure_logging

        configure_logging("console")
    return int(args.func(args))
