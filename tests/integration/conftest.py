"""Fixtures of the integration tests: the Redis limiter on the session's redis-server, the
limiter contract suite's backends (the in-memory limiter, the Redis limiter on that server and
on a real three-node Redis Cluster, started once per session when a test asks for it), and
``ai-quota serve`` with the RLS API."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from extproc.limiter.memory import MemoryLimiter
from extproc.limiter.redis import RedisLimiter
from extproc.stack import free_port, port_in_use
from tests.helpers import RedisServer, spawn
from tests.limiters import Backend, MemoryProbe, RedisProbe
from tests.rls_support import Server


@pytest.fixture
async def lim(redis_server: RedisServer) -> AsyncIterator[RedisLimiter]:
    """The Redis limiter (1 s per call: these tests assert behaviour, not Redis latency)."""
    limiter = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    yield limiter
    await limiter.close()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each limiter the contract suite holds for, with the test's own view of its state: the
    in-memory limiter, and the Redis limiter on one server and on a three-node Cluster (1 s
    per call: these tests assert behaviour, not Redis latency)."""
    if request.param == "memory":
        memory = MemoryLimiter()
        yield Backend("memory", memory, MemoryProbe(memory))
        return
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
        probe = RedisProbe(Redis(port=server.port, decode_responses=True))
    else:
        ports: list[int] = request.getfixturevalue("cluster")
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        probe = RedisProbe(RedisCluster(host="127.0.0.1", port=ports[0], decode_responses=True))
    limiter = RedisLimiter.from_url(url, timeout_ms=1000)
    try:
        yield Backend(request.param, limiter, probe)
    finally:
        await limiter.close()
        await probe.close()


def _port_with_bus() -> int:
    """A free port whose cluster-bus port (port + 10000) is valid and free too."""

    while True:
        p = free_port()
        if p + 10000 <= 65535 and not port_in_use(p + 10000):
            return p


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Three masters on free ports, slots assigned with redis-cli --cluster create."""
    server = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail("redis-server and redis-cli are required (apt-get install redis-server)")
    base = Path(tmp_path_factory.mktemp("cluster"))
    ports = [_port_with_bus() for _ in range(3)]
    procs = []
    for p in ports:
        d = base / str(p)
        d.mkdir()
        procs.append(
            spawn(
                [
                    server,
                    "--port",
                    str(p),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(d / "nodes.conf"),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(d),
                ],
                d / "log",
            )
        )
    try:
        for p in ports:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with redis.Redis(port=p) as client:
                        client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 20
        with redis.Redis(port=ports[0]) as client:
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    pytest.fail("the test cluster did not reach state ok")
                time.sleep(0.1)
        yield ports
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait(10)


@pytest.fixture
async def serve(redis_server: RedisServer) -> AsyncIterator[Server]:
    """``await serve(rls_config, **settings)``: ``ai-quota serve`` in process with the RLS API
    on the session's redis-server; every server started is stopped after the test."""
    server = Server(redis_server.url)
    yield server
    await server.close()
