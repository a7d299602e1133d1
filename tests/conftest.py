"""Session fixtures: a real redis-server for integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.helpers import RedisServer


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """Undo an in-process ``ai-quota`` call's logging set-up after each test.

    The CLI binds structlog to the ``sys.stderr`` of the moment, which under pytest is a
    capture file closed after the test; a later test logging through it would fail with
    "I/O operation on closed file".
    """
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the whole session (tests use distinct keys)."""
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()
