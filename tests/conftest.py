"""Session fixtures: a real redis-server for integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the whole session (tests use distinct keys)."""
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()
