"""Fixtures the fault tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import RedisServer


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, with DEBUG enabled (DEBUG SLEEP stalls it)."""
    server = RedisServer(tmp_path / "redis", extra=["--enable-debug-command", "yes"])
    yield server
    server.stop()
