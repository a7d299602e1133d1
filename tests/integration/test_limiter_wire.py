"""The limiter's Redis connections use hiredis both ways: replies parsed and commands packed in C."""

from __future__ import annotations

from typing import Any

import pytest
import redis.utils
from redis._parsers.hiredis import _AsyncHiredisParser
from redis.asyncio.connection import Connection

from extproc.limiter.packing import HiredisPacking
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration


def _live_connections(lim: RedisLimiter) -> list[Any]:
    client: Any = lim.caller.client
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return [*pool._available_connections, *pool._in_use_connections]
    conns: list[Any] = []
    for node in client.nodes_manager.nodes_cache.values():
        conns += [*node._connections]
    return conns


def _assert_hiredis(conns: list[Any]) -> None:
    assert conns, "no connection was opened"
    for conn in conns:
        assert isinstance(conn._parser, _AsyncHiredisParser), type(conn._parser)
        assert isinstance(conn, HiredisPacking), type(conn)


async def test_single_server_connections_parse_and_pack_with_hiredis(
    redis_server: RedisServer,
) -> None:
    """A limiter's pooled connection parses with hiredis and packs with hiredis (never pure Python)."""
    assert redis.utils.HIREDIS_AVAILABLE, "hiredis is not importable: redis-py parses in Python"
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    try:
        assert await lim.read(["t:{wire}:a"]) == [0]
        _assert_hiredis(_live_connections(lim))
    finally:
        await lim.close()


async def test_cluster_connections_parse_and_pack_with_hiredis(cluster: list[int]) -> None:
    """On Redis Cluster every node's connection (discovered after start-up too) uses hiredis."""
    lim = RedisLimiter.from_url(f"redis+cluster://127.0.0.1:{cluster[0]}", timeout_ms=2000)
    try:
        # keys on different nodes: connections to several discovered nodes
        for tag in ("a", "b", "c", "d", "e", "f"):
            assert await lim.read([f"t:{{{tag}}}:x"]) == [0]
        conns = _live_connections(lim)
        assert len({(c.host, c.port) for c in conns}) >= 2
        _assert_hiredis(conns)
    finally:
        await lim.close()


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "t:{x}:led", "t:{x}:rpm", 60000, "0", -5, 1.5, "é", b"\x00\xff"),
        ("SCRIPT LOAD", "return 1"),
        (b"CLIENT SETNAME", "n"),
        ("SET", "k", bytearray(b"v"), memoryview(b"w")),
    ],
)
def test_hiredis_packing_is_byte_identical_to_redis_py(args: tuple[Any, ...]) -> None:
    """The C packer writes the same bytes as redis-py's own packer, multi-word commands included."""
    ours = HiredisPacking.pack_command(Connection(), *args)  # type: ignore[arg-type]
    theirs = Connection().pack_command(*args)
    assert b"".join(ours) == b"".join(bytes(p) for p in theirs)


def test_hiredis_packing_rejects_unencodable_arguments() -> None:
    """An argument neither str, bytes nor number is a clear DataError, as with redis-py."""
    with pytest.raises(redis.exceptions.DataError, match="invalid argument"):
        HiredisPacking.pack_command(Connection(), "SET", "k", None)  # type: ignore[arg-type]


async def test_usage_recorder_connections_pack_with_hiredis(redis_server: RedisServer) -> None:
    """The usage-record writer's connections pack with hiredis too (a batch of records is a
    thousand arguments), and what they write reads back as the records written."""
    from extproc.records.model import UsageRecord
    from extproc.records.writer import UsageRecorder

    rec = UsageRecorder.from_url(redis_server.url, "aiq:usage:wire", linger_s=0)
    try:
        rec.record(
            UsageRecord(
                request_id="r-1",
                tenant="t-é",
                key="k",
                model="m",
                api="chat",
                input_tokens=7,
                output_tokens=3,
                ending="completed",
                admitted_at_ms=1,
                finished_at_ms=2,
            )
        )
        await rec.flush(5.0)
        pool = rec.client.connection_pool
        _assert_hiredis([*pool._available_connections, *pool._in_use_connections])
        entries = await rec.client.xrange("aiq:usage:wire")
        back = UsageRecord.from_fields(entries[0][1])
        assert (back.request_id, back.tenant, back.input_tokens) == ("r-1", "t-é", 7)
    finally:
        await rec.client.aclose()
