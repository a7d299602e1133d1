"""A journal replay on a new master after a failover (issue 32, the frozen primary): the new
master may get a request's later calls (a stream charge, the settlement) before the journal's
replay of the earlier ones the old master acknowledged and lost (its admission, earlier
charges).  Every call is applied once whatever the order: the counters on the new master end
where the old master's ended, to the token, and replaying everything again changes nothing.
Two real redis-servers: the old master, where the calls run in order, and a fresh one as the
new master."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from extproc.core.keys import open_key
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.base import AdmitCall
from extproc.limiter.journal import Entry
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer

pytestmark = pytest.mark.integration

TTL = 60_000


def far() -> int:
    return int(time.time() * 1000) + 120_000


@pytest.fixture
async def masters(tmp_path: Path) -> AsyncIterator[tuple[RedisLimiter, RedisLimiter, Redis]]:
    old = RedisServer(tmp_path / "old")
    new = RedisServer(tmp_path / "new")
    a = RedisLimiter.from_url(old.url, timeout_ms=1000)
    b = RedisLimiter.from_url(new.url, timeout_ms=1000)
    probe = Redis(port=new.port)
    yield a, b, probe
    await a.close()
    await b.close()
    await probe.aclose()
    old.stop()
    new.stop()


async def _request(a: RedisLimiter, tag: str, *, strict: bool = False) -> list[Entry]:
    """Admission (500 reserved, a concurrency slot, a lease), two stream charges, settlement
    (-300) on the old master, in order; the journal's entries of this request."""
    assert a.failover is not None
    before = len(a.failover.journal)
    led = f"{tag}:req:1"
    await a.admit(
        AdmitCall(
            led,
            [
                BucketCharge(f"{tag}:rpm", "rpm", 1, 100, far()),
                BucketCharge(f"{tag}:tpm", "tpm", 500, 100_000, far(), refundable=400),
                BucketCharge(f"{tag}:conc", "concurrency", 1, 10, far()),
            ],
            tpm_charged=500,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=int(time.time() * 1000),
            lease_until_ms=far(),
        )
    )
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 40, 100_000, far())]
    for seq in (1, 2):
        r = await a.charge(f"{tag}:req:1", seq, tpm, 40, strict=strict, ledger_ttl_ms=TTL)
        assert r.granted == 40
    assert await a.settle(led, [Adjustment(f"{tag}:tpm", -300, far())], ledger_ttl_ms=TTL)
    return list(a.failover.journal)[before:]


async def _replay(b: RedisLimiter, entries: list[Entry]) -> None:
    for e in entries:
        await b.caller.scripts[e.script](keys=e.keys, args=e.args)


async def _state(r: Redis, tag: str) -> tuple[int, int, int, bool, bytes | str | None]:
    """TPM, RPM, concurrency slots held, whether the ledger is an open reservation, its
    state."""
    led = f"{tag}:req:1"
    return (
        int(await r.get(f"{tag}:tpm") or 0),
        int(await r.get(f"{tag}:rpm") or 0),
        int(await r.zcard(f"{tag}:conc")),
        await r.zscore(open_key(led), led) is not None,
        await r.hget(led, "state"),
    )


async def test_every_order_of_a_requests_calls_ends_where_the_old_master_did(
    masters: tuple[RedisLimiter, RedisLimiter, Redis],
) -> None:
    """Each of the 24 orders of (admission, charge 1, charge 2, settlement) on the new master,
    then the whole journal replayed again: TPM 500 + 40 + 40 - 300 = 280, RPM 1, no slot held,
    the ledger settled: what the old master holds."""
    a, b, probe = masters
    old = Redis(port=int(str(a.caller.client.connection_pool.connection_kwargs["port"])))
    try:
        for order in itertools.permutations(range(4)):
            tag = f"t:{{o-{uuid.uuid4().hex[:8]}}}"
            entries = await _request(a, tag)
            assert [e.script for e in entries] == ["admit", "charge", "charge", "settle"]
            await _replay(b, [entries[i] for i in order])
            want = await _state(old, tag)
            assert want == (280, 1, 0, False, b"settled")
            assert await _state(probe, tag) == want, order
            await _replay(b, entries)  # everything again: nothing twice
            assert await _state(probe, tag) == want, order
    finally:
        await old.aclose()


async def test_a_live_charge_after_the_settlement_still_charges_nothing(
    masters: tuple[RedisLimiter, RedisLimiter, Redis],
) -> None:
    """Only the journal's replay form ("r") of a charge counted by the settlement applies
    after it; a live charge the settlement did not count (sent late) stays a no-op."""
    a, b, probe = masters
    tag = f"t:{{l-{uuid.uuid4().hex[:8]}}}"
    entries = await _request(a, tag)
    await _replay(b, [entries[3]])  # the settlement first
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 40, 100_000, far())]
    late = await b.charge(f"{tag}:req:1", 3, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert late.granted == 0
    await _replay(b, entries[:3])
    assert int(await probe.get(f"{tag}:tpm") or 0) == 280
