"""A processor that dies holding reservations leaks them only until its lease runs out: the
tenant's next admission refunds the reserved output (admit.lua), a live processor renewing its
lease keeps it, and a late settlement of a reclaimed ledger puts it back first."""

from __future__ import annotations

import uuid

import pytest
import redis

from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer, far_ms

pytestmark = pytest.mark.integration

TTL = 600_000
LEASE = 10_000


def setup() -> tuple[str, list[BucketCharge]]:
    tag = f"aiq:{{r-{uuid.uuid4().hex[:8]}}}"
    return tag, [
        BucketCharge(f"{tag}:rpm", "rpm", 1, 100, far_ms()),
        BucketCharge(
            f"{tag}:tpm", "tpm", 1_010, 100_000, far_ms(), refundable=1_000
        ),  # 10 + 1000 reserved
    ]


async def admit(lim: RedisLimiter, tag: str, charges: list[BucketCharge], now: int, n: int) -> None:
    res = await lim.admit(
        f"{tag}:req:{n}",
        charges,
        tpm_charged=1_010,
        count_refused=False,
        ledger_ttl_ms=TTL,
        now_ms=now,
        lease_until_ms=now + LEASE,
    )
    assert res.admitted


async def test_dead_reservation_is_refunded_by_the_next_admission(
    lim: RedisLimiter, redis_server: RedisServer
) -> None:
    r = redis.Redis(port=redis_server.port)
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)  # its processor dies: never settled
    assert int(r.get(f"{tag}:tpm") or 0) == 1_010
    await admit(lim, tag, charges, now + LEASE - 1, 2)  # lease still running: nothing back
    assert int(r.get(f"{tag}:tpm") or 0) == 2_020
    await admit(lim, tag, charges, now + LEASE + 1, 3)  # lease over: 1's reservation back
    assert int(r.get(f"{tag}:tpm") or 0) == 2_020 - 1_000 + 1_010
    assert r.hget(f"{tag}:req:1", "state") == b"reclaimed"
    assert r.zscore(f"{tag}:open", f"{tag}:req:1") is None


async def test_renewed_lease_is_not_reclaimed(lim: RedisLimiter, redis_server: RedisServer) -> None:
    r = redis.Redis(port=redis_server.port)
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)
    await lim.renew([f"{tag}:req:1"], now + 3 * LEASE)
    await admit(lim, tag, charges, now + 2 * LEASE, 2)
    assert int(r.get(f"{tag}:tpm") or 0) == 2_020
    assert r.hget(f"{tag}:req:1", "state") == b"admitted"


async def test_settled_reservation_leaves_the_open_set_and_is_never_reclaimed(
    lim: RedisLimiter, redis_server: RedisServer
) -> None:
    r = redis.Redis(port=redis_server.port)
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)
    await lim.settle(f"{tag}:req:1", [Adjustment(f"{tag}:tpm", -900, far_ms())], ledger_ttl_ms=TTL)
    await lim.renew([f"{tag}:req:1"], now + 5 * LEASE)  # XX: a settled one is not re-added
    assert r.zscore(f"{tag}:open", f"{tag}:req:1") is None
    await admit(lim, tag, charges, now + 2 * LEASE, 2)
    assert int(r.get(f"{tag}:tpm") or 0) == 110 + 1_010


async def test_late_settlement_of_a_reclaimed_ledger_is_exact(
    lim: RedisLimiter, redis_server: RedisServer
) -> None:
    """The processor was alive but its renewals were lost: settlement restores, then corrects."""
    r = redis.Redis(port=redis_server.port)
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)
    await admit(lim, tag, charges, now + LEASE + 1, 2)  # reclaims 1
    # 1 really generated 300 tokens: its processor settles 1010 -> 310 (-700)
    await lim.settle(f"{tag}:req:1", [Adjustment(f"{tag}:tpm", -700, far_ms())], ledger_ttl_ms=TTL)
    assert int(r.get(f"{tag}:tpm") or 0) == 310 + 1_010
