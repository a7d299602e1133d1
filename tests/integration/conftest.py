"""Fixtures of the integration tests: a limiter on the session's redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer


@pytest.fixture
async def lim(redis_server: RedisServer) -> AsyncIterator[RedisLimiter]:
    """The Redis limiter (1 s per call: these tests assert behaviour, not Redis latency)."""
    limiter = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    yield limiter
    await limiter.close()
