"""structlog set-up: one JSON line per event in production, readable console output locally."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import orjson
import structlog


def configure_logging(fmt: Literal["json", "console"] = "json", level: str = "info") -> None:
    """Configure structlog once per process."""
    renderer: structlog.typing.Processor
    factory: structlog.typing.WrappedLogger
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    else:
        # orjson renders straight to bytes (about 5x faster than the stdlib encoder); one
        # write per line, no str round trip.
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
