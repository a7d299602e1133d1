"""Command line of the upstream simulator: ``ai-quota sim`` and ``python -m extproc.sim``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from typing import Any

import structlog

from extproc.sim.app import start_sim
from extproc.sim.config import TEXT_MODES, SimConfig

log = structlog.get_logger(__name__)

_DESCRIPTION = """\
OpenAI-compatible upstream simulator. Serves /v1/chat/completions, /v1/completions,
/v1/responses, /v1/messages (Anthropic), /v1/embeddings and /v1/models with deterministic,
token-exact text (every piece is one cl100k_base token), injects
latency and faults per request via x-sim-* headers, and records per-request ground truth
(tokens actually written, how the request ended) under /sim/requests and /sim/stats.
Command-line flags override values from --config. See docs/simulator.md.
"""

_EPILOG = """\
per-request headers: x-sim-tokens, x-sim-seed, x-sim-ttft-ms, x-sim-itl-ms,
x-sim-tokens-per-chunk, x-sim-reasoning, x-sim-tool-call, x-sim-status, x-sim-slow-start-ms,
x-sim-disconnect-after, x-sim-malformed-after, x-sim-error-event-after,
x-sim-chunk-tokens, x-sim-burst-tokens, x-sim-gzip, x-sim-honour-accept-encoding,
x-sim-content-type, x-sim-usage, x-sim-prompt-usage, x-sim-ignore-max-tokens,
x-sim-content-length
"""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to ``parser`` (all default to None = take config/defaults)."""
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = SimConfig()
    parser.add_argument("--config", metavar="FILE", help="YAML file with SimConfig fields")
    parser.add_argument("--host", help=f"listen address (default {defaults.host})")
    parser.add_argument(
        "--port", type=int, help=f"listen port, 0 = any free port (default {defaults.port})"
    )
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        metavar="ID",
        help=f"served model id, repeatable (default {', '.join(defaults.models)})",
    )
    parser.add_argument(
        "--ttft-ms", type=float, help=f"time to first token in ms (default {defaults.ttft_ms:g})"
    )
    parser.add_argument(
        "--itl-ms", type=float, help=f"inter-token latency in ms (default {defaults.itl_ms:g})"
    )
    parser.add_argument(
        "--tokens-per-chunk",
        type=int,
        help=f"tokens per streamed chunk (default {defaults.tokens_per_chunk})",
    )
    parser.add_argument(
        "--default-tokens",
        type=int,
        help=f"length when the request has no max_tokens (default {defaults.default_tokens})",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        help=f"upper bound on any answer length (default {defaults.max_tokens_cap})",
    )
    parser.add_argument(
        "--seed", type=int, help=f"text seed when x-sim-seed is absent (default {defaults.seed})"
    )
    parser.add_argument(
        "--text-mode",
        choices=TEXT_MODES,
        help=f"generated text style (default {defaults.text_mode})",
    )
    parser.add_argument(
        "--max-records",
        type=int,
        help=f"ground-truth ring buffer size (default {defaults.max_records})",
    )
    parser.add_argument(
        "--context-tokens",
        type=int,
        help="context window; with x-sim-ignore-max-tokens a request without max_tokens runs"
        f" to its end (default {defaults.context_tokens})",
    )
    parser.add_argument(
        "--log-format", choices=("console", "json"), default="console", help="log output format"
    )
    parser.add_argument(
        "--reuse-port",
        action="store_const",
        const=True,
        help="listen with SO_REUSEPORT, so that several simulator processes share the port "
        "(each keeps its own /sim/requests records)",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="minimum log level (debug logs every completed request)",
    )


_OVERRIDES = (
    "host",
    "port",
    "models",
    "ttft_ms",
    "itl_ms",
    "tokens_per_chunk",
    "default_tokens",
    "max_tokens_cap",
    "seed",
    "text_mode",
    "max_records",
    "context_tokens",
    "reuse_port",
)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """SimConfig from ``--config`` (if given) with explicit flags applied on top."""
    path = getattr(args, "config", None)
    config = SimConfig.from_yaml(path) if path else SimConfig()
    changes: dict[str, Any] = {}
    for name in _OVERRIDES:
        value = getattr(args, name, None)
        if value is not None:
            changes[name] = tuple(value) if name == "models" else value
    return dataclasses.replace(config, **changes) if changes else config


def setup_logging(fmt: str, level: str) -> None:
    """Configure structlog for console or JSON lines on stderr."""
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


async def _serve(config: SimConfig) -> None:
    runner, _port = await start_sim(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("sim_stopping")
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code."""
    setup_logging(getattr(args, "log_format", "console"), getattr(args, "log_level", "info"))
    try:
        config = config_from_args(args)
    except (OSError, ValueError) as exc:
        log.error("sim_bad_config", error=str(exc))
        return 2
    try:
        asyncio.run(_serve(config))
    except OSError as exc:
        log.error("sim_listen_failed", host=config.host, port=config.port, error=str(exc))
        return 1
    return 0
