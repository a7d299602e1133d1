"""The same Lua scripts on a real three-node Redis Cluster: every call's keys share one slot."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from extproc.clock import FakeClock
from extproc.core.keys import ledger_key, windowed
from extproc.core.rules import Adjustment, BucketCharge, Limit
from extproc.limiter.redis import RedisLimiter

pytestmark = pytest.mark.integration


async def test_admit_charge_settle_on_a_cluster(cluster: list[int]) -> None:
    """Admission, a stream charge and settlement run on Redis Cluster without CROSSSLOT errors."""
    lim = RedisLimiter.from_url(
        f"redis+cluster://127.0.0.1:{cluster[0]}", timeout_ms=2000, clock=FakeClock()
    )
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    limits = (
        Limit("rpm", 10, 60, "*", "tenant"),
        Limit("tpm", 1000, 60, "*", "tenant"),
        Limit("tpm", 500, 3600, "m", "key"),
    )
    now = int(time.time() * 1000)
    buckets = windowed("aiq", tenant, "k1", limits, now)
    led = ledger_key("aiq", tenant, "req-1")
    charges = [
        BucketCharge(
            b.key, b.metric, 1 if b.metric == "rpm" else 100, b.limit.limit, b.expire_at_ms
        )
        for b in buckets
    ]
    res = await lim.admit(led, charges, tpm_charged=100, count_refused=False, ledger_ttl_ms=60_000)
    assert res.admitted and res.values == (1, 100, 100)
    tpm = [c for c in charges if c.kind == "tpm"]
    ch = await lim.charge(led, 1, tpm, 450, strict=True, ledger_ttl_ms=60_000)
    assert ch.granted == 400 and ch.exhausted  # the 500/hour key bucket binds
    assert await lim.settle(
        led, [Adjustment(c.key, -300, c.expire_at_ms) for c in tpm], ledger_ttl_ms=60_000
    )
    assert await lim.read([b.key for b in buckets]) == [1, 200, 200]
    await lim.close()
    # every key of the tenant lives in one slot
    r = redis.Redis(port=cluster[0])
    slots = {r.cluster("keyslot", b.key) for b in buckets} | {r.cluster("keyslot", led)}
    assert len(slots) == 1
