"""What the in-memory limiter adds to the contract suite: expiry follows its clock as Redis
follows its own (windows end, ledgers lapse), and a key used as another kind is an error."""

from __future__ import annotations

import pytest

from extproc.clock import FakeClock
from extproc.core.rules import Adjustment, BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.memory import MemoryLimiter

pytestmark = pytest.mark.unit

T0 = 1_700_000_000_000


def tpm(key: str, amount: int, expire_at: int, limit: int = 100) -> BucketCharge:
    """A TPM bucket."""
    return BucketCharge(key, "tpm", amount, limit, expire_at)


async def test_a_window_ends_at_its_expiry_and_a_refund_to_it_is_dropped() -> None:
    """A counter lives until its expiry (inclusive), then reads 0; a refund to it is lost."""
    clock = FakeClock(T0)
    lim = MemoryLimiter(clock)
    res = await lim.admit(
        AdmitCall(
            "{a}:req:1",
            [tpm("{a}:w1", 60, T0 + 1_000)],
            tpm_charged=60,
            count_refused=False,
            ledger_ttl_ms=60_000,
        )
    )
    assert res.admitted and lim.ttl_ms("{a}:w1") == 1_000
    clock.advance(1.0)
    assert await lim.read(["{a}:w1"]) == [60]  # at the expiry: still there (Redis: now > at)
    clock.advance(0.001)
    assert await lim.read(["{a}:w1"]) == [0] and lim.counter("{a}:w1") is None
    assert await lim.settle("{a}:req:1", [Adjustment("{a}:w1", -50, T0)], ledger_ttl_ms=60_000)
    assert lim.counter("{a}:w1") is None  # not revived


async def test_an_expiry_in_the_past_deletes_at_once() -> None:
    """A charge whose window already ended leaves no counter (PEXPIREAT in the past)."""
    lim = MemoryLimiter(FakeClock(T0))
    res = await lim.admit(
        AdmitCall(
            "{b}:req:1",
            [tpm("{b}:old", 5, T0 - 1)],
            tpm_charged=5,
            count_refused=False,
            ledger_ttl_ms=60_000,
        )
    )
    assert res.admitted and res.values == (5,)
    assert lim.counter("{b}:old") is None


async def test_a_lapsed_ledger_no_longer_marks_a_replay() -> None:
    """Within the ledger TTL a replayed id is a duplicate; after it, it is a new request."""
    clock = FakeClock(T0)
    lim = MemoryLimiter(clock)
    far = T0 + 3_600_000
    for _ in range(2):
        await lim.admit(
            AdmitCall(
                "{c}:req:1",
                [tpm("{c}:w", 10, far)],
                tpm_charged=10,
                count_refused=False,
                ledger_ttl_ms=5_000,
            )
        )
    assert lim.counter("{c}:w") == 10 and lim.ledger_state("{c}:req:1") == "admitted"
    clock.advance(5.001)
    assert lim.ledger_state("{c}:req:1") is None
    res = await lim.admit(
        AdmitCall(
            "{c}:req:1",
            [tpm("{c}:w", 10, far)],
            tpm_charged=10,
            count_refused=False,
            ledger_ttl_ms=5_000,
        )
    )
    assert res.admitted and res.values == (20,)


async def test_a_key_used_as_another_kind_is_a_limiter_error() -> None:
    """A concurrency set read as a counter fails as Redis's WRONGTYPE does."""
    lim = MemoryLimiter(FakeClock(T0))
    conc = BucketCharge("{d}:c", "concurrency", 1, 5, T0 + 60_000)
    await lim.admit(
        AdmitCall(
            "{d}:req:1",
            [conc],
            tpm_charged=0,
            count_refused=False,
            ledger_ttl_ms=60_000,
            now_ms=T0,
            lease_until_ms=T0 + 10_000,
        )
    )
    with pytest.raises(LimiterUnavailable, match="holds a sorted set, not a counter"):
        await lim.charge(
            "{d}:req:1", 1, [tpm("{d}:c", 0, T0 + 60_000)], 4, strict=False, ledger_ttl_ms=60_000
        )
    assert await lim.read(["{d}:c"]) == [0]  # MGET reads a non-counter as missing
    assert await lim.count_slots(["{d}:c"], T0) == [1]
