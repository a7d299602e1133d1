"""Finding a Sentinel group's new master before its failover ends (issue 32's open p99 miss).

A real group (a master, two replicas, three sentinels, down-after 1 s): the master is
SIGKILLed and two discoverers are polled side by side, alternately, every few milliseconds:
redis-py's own (the address in ``SENTINEL MASTERS`` once not flagged down, which a failover
updates at ``+switch-master``, after the other replica is reconfigured) and the processor's
(:class:`extproc.limiter.redis_url.PromptSentinel`, which also takes the replica the leading
sentinel names from its promotion on, once that server answers ``ROLE`` as a master)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.sentinel as aiosentinel

from extproc.bench.redis_ha import SentinelGroup
from extproc.limiter.redis_url import async_client, parse_redis_url

pytestmark = pytest.mark.faults

POLL_S = 0.005


def _role(port: int) -> str:
    with redis.Redis(port=port, socket_timeout=1) as c:
        return str(c.execute_command("ROLE")[0], "ascii")


async def _race(group: SentinelGroup, ours: Any, theirs: Any) -> dict[str, int]:
    """Kill the master; poll redis-py's discoverer, then ours, each turn (so that ours, asked
    second, sees at least what redis-py saw); the turn at which each named a new master."""
    old = group.master_port()
    assert await ours.discover_master(group.name) == ("127.0.0.1", old)
    group.kill(old)
    found: dict[str, int] = {}
    deadline = time.monotonic() + 30
    turn = 0
    while len(found) < 2 and time.monotonic() < deadline:
        turn += 1
        for name, manager in (("theirs", theirs), ("ours", ours)):
            if name in found:
                continue
            try:
                host, port = await manager.discover_master(group.name)
            except aiosentinel.MasterNotFoundError:
                continue
            if int(port) == old:
                continue  # not flagged down yet (down-after 1 s)
            if name == "ours":
                assert _role(int(port)) == "master", (host, port)
            found[name] = turn
        await asyncio.sleep(POLL_S)
    assert set(found) == {"ours", "theirs"}, found
    return found


async def test_the_promoted_replica_is_found_before_the_failover_ends(tmp_path: Path) -> None:
    """Two failovers in a row (the master killed, then the replica promoted in its place):
    ours names a new master no later than redis-py's, and every address it gives after a kill
    is a server answering as a master (never the dead one, never a replica).  How much sooner
    depends on when the other sentinels hear the leader's new configuration (their hello
    messages, every 2 s): 0.075 s after the promotion in a quiet run here, 1.06 s in the
    strict drill's slow run (docs/operations.md)."""
    group = SentinelGroup(tmp_path, replicas=2)
    client = async_client(parse_redis_url(group.url()), timeout_s=0.5)
    ours = client.connection_pool.sentinel_manager
    theirs = aiosentinel.Sentinel(
        [("127.0.0.1", p) for p in group.sentinel_ports], sentinel_kwargs={"socket_timeout": 0.5}
    )
    try:
        for _ in range(2):
            found = await _race(group, ours, theirs)
            print(f"\nturns ({POLL_S * 1000:.0f} ms apart) to find the new master: {found}")
            assert found["ours"] <= found["theirs"], found
    finally:
        await client.aclose()
        for s in theirs.sentinels:
            await s.aclose()
        group.stop()
