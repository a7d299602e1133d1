"""The limiter contract (every backend: in-memory, Redis, Redis Cluster) with money budgets,
shadow limits and concurrency slots: strict grants bounded by a budget's price, lazy overs, shadow buckets that never bind,
slots taken, freed by settlement, and reclaimed from a dead processor after its lease."""

from __future__ import annotations

import time
import uuid

import pytest

from extproc.core.rules import RATE_SCALE, Adjustment, BucketCharge, UnconfirmedCharge
from extproc.limiter.base import AdmitCall, Limiter
from tests.helpers import far_ms
from tests.limiters import Backend

pytestmark = pytest.mark.integration

TTL = 600_000
LEASE = 10_000


def tag() -> str:
    return f"aiq:{{b-{uuid.uuid4().hex[:8]}}}"


def budget(t: str, limit: int, *, shadow: bool = False, amount: int = 0) -> BucketCharge:
    """A money counter: 15 micro-dollars per output token ($15 per million)."""
    name = "cost.shadow" if shadow else "cost"
    return BucketCharge(
        f"{t}:{name}", "tpm", amount, limit, far_ms(), rate=15_000_000, shadow=shadow
    )


async def test_strict_grant_is_bounded_by_the_budget_price(backend: Backend) -> None:
    """A strict lease grants only the tokens the budget can still pay for, then says so."""
    lim = backend.limiter
    t = tag()
    res = await lim.admit(
        AdmitCall(
            f"{t}:req:1",
            [budget(t, 1_000, amount=100)],
            tpm_charged=0,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    assert res.admitted and res.values == (100,)
    got = await lim.charge(f"{t}:req:1", 1, [budget(t, 1_000)], 64, strict=True, ledger_ttl_ms=TTL)
    assert got.granted == 60  # 900 micro-dollars left / 15 per token
    assert got.values == (1_000,) and got.exhausted
    again = await lim.charge(
        f"{t}:req:1", 2, [budget(t, 1_000)], 64, strict=True, ledger_ttl_ms=TTL
    )
    assert again.granted == 0 and again.exhausted


async def test_lazy_charge_goes_over_and_reports_it(backend: Backend) -> None:
    """Lazy charges all it was asked (rounded up per charge) and flags the overshoot."""
    lim = backend.limiter
    t = tag()
    await lim.admit(
        AdmitCall(
            f"{t}:req:1", [budget(t, 1_000)], tpm_charged=0, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    c = BucketCharge(f"{t}:cost", "tpm", 0, 1_000, far_ms(), rate=1_500_000)  # 1.5 per token
    got = await lim.charge(f"{t}:req:1", 1, [c], 7, strict=False, ledger_ttl_ms=TTL)
    assert got.granted == 7 and got.values == (11,) and not got.exhausted  # ceil(10.5)
    got = await lim.charge(f"{t}:req:1", 2, [c], 700, strict=False, ledger_ttl_ms=TTL)
    assert got.values == (11 + 1_050,) and got.exhausted


async def test_shadow_buckets_never_refuse_nor_limit_a_grant(backend: Backend) -> None:
    """A shadow budget already past its limit admits, grants in full and never ends a stream."""
    lim = backend.limiter
    t = tag()
    shadow = budget(t, 10, shadow=True, amount=500)
    res = await lim.admit(
        AdmitCall(f"{t}:req:1", [shadow], tpm_charged=0, count_refused=False, ledger_ttl_ms=TTL)
    )
    assert res.admitted and res.values == (500,)
    got = await lim.charge(
        f"{t}:req:1", 1, [budget(t, 10, shadow=True)], 64, strict=True, ledger_ttl_ms=TTL
    )
    assert got.granted == 64 and not got.exhausted and got.values == (500 + 960,)


def slot(t: str, limit: int, now: int) -> BucketCharge:
    # slot sets expire in real time: ``now`` is the test's own start, not the module's import
    return BucketCharge(f"{t}:conc", "concurrency", 1, limit, now + 3 * LEASE)


async def admit_slot(lim: Limiter, t: str, n: int, now: int, limit: int = 2) -> bool:
    res = await lim.admit(
        AdmitCall(
            f"{t}:req:{n}",
            [slot(t, limit, now)],
            tpm_charged=0,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=now,
            lease_until_ms=now + LEASE,
        )
    )
    return res.admitted


async def test_concurrency_slots_are_taken_and_freed_by_settlement(backend: Backend) -> None:
    """Two slots: a third request is refused until one of the two settles."""
    lim = backend.limiter
    r = backend.probe
    t = tag()
    now = int(time.time() * 1000)
    assert await admit_slot(lim, t, 1, now)
    assert await admit_slot(lim, t, 2, now)
    assert not await admit_slot(lim, t, 3, now)
    assert await r.members(f"{t}:conc") == 2
    assert await lim.settle(f"{t}:req:1", [], ledger_ttl_ms=TTL)
    assert await r.members(f"{t}:conc") == 1
    assert await admit_slot(lim, t, 4, now)


async def test_a_dead_processor_leaks_a_slot_only_until_its_lease_ends(backend: Backend) -> None:
    """Slots of a processor that never settles come back once their lease runs out; renewed
    slots stay."""
    lim = backend.limiter
    r = backend.probe
    t = tag()
    now = int(time.time() * 1000)
    assert await admit_slot(lim, t, 1, now)  # its processor dies
    assert await admit_slot(lim, t, 2, now)  # a live one, renewing
    await lim.renew([f"{t}:req:2"], now + 3 * LEASE, held={f"{t}:req:2": [f"{t}:conc"]})
    assert not await admit_slot(lim, t, 3, now + LEASE - 1)
    assert await admit_slot(lim, t, 4, now + LEASE + 1)  # 1's lease is over
    assert await r.ledger_state(f"{t}:req:1") == "reclaimed"
    assert await r.score(f"{t}:conc", f"{t}:req:1") is None
    assert await r.score(f"{t}:conc", f"{t}:req:2") == now + 3 * LEASE


async def test_sliding_window_counts_the_previous_window_by_its_share(backend: Backend) -> None:
    """Limit 100 per minute, 100 admitted in the previous minute: 15 s into this one, 75 of
    them still count, so 25 more are admitted and the 26th is refused (a fixed window would
    admit 100 more)."""
    lim = backend.limiter
    t = tag()
    prev, cur = f"{t}:rpm.sliding:9", f"{t}:rpm.sliding:10"
    await backend.probe.seed_counter(prev, 100)

    def rpm(n: int) -> BucketCharge:
        return BucketCharge(cur, "rpm", 1, 100, far_ms(), prev_key=prev, prev_weight=750_000)

    admitted = 0
    for n in range(40):
        res = await lim.admit(
            AdmitCall(
                f"{t}:req:{n}", [rpm(n)], tpm_charged=0, count_refused=False, ledger_ttl_ms=TTL
            )
        )
        admitted += res.admitted
        if not res.admitted:
            assert res.values == (100,)  # 75 from the previous minute + 25 in this one
            break
    assert admitted == 25
    tpm = BucketCharge(cur + ":t", "tpm", 0, 100, far_ms(), prev_key=prev, prev_weight=750_000)
    await lim.admit(
        AdmitCall(f"{t}:req:s", [tpm], tpm_charged=0, count_refused=False, ledger_ttl_ms=TTL)
    )
    got = await lim.charge(f"{t}:req:s", 1, [tpm], 64, strict=True, ledger_ttl_ms=TTL)
    assert got.granted == 25 and got.values == (100,) and got.exhausted


# -- calls that timed out on our side but ran (or will run) on Redis ------------------------


def tpm(t: str, amount: int) -> BucketCharge:
    return BucketCharge(f"{t}:tpm", "tpm", amount, 1_000_000, far_ms())


async def test_cancel_undoes_an_admission_that_ran_after_all(backend: Backend) -> None:
    """The admission's answer never came, but it ran: the kept cancel refunds all of it."""
    lim = backend.limiter
    r = backend.probe
    t = tag()
    await lim.admit(
        AdmitCall(
            f"{t}:req", [tpm(t, 120)], tpm_charged=120, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    undo = [Adjustment(f"{t}:tpm", -120, far_ms())]
    assert await lim.settle(f"{t}:req", undo, ledger_ttl_ms=TTL, cancel=True)
    assert (await r.counter(f"{t}:tpm") or 0) == 0


async def test_cancel_before_a_late_admission_stops_it_from_charging(backend: Backend) -> None:
    """The cancel reaches Redis first (another connection): the admission, arriving late,
    finds the ledger and charges nothing."""
    lim = backend.limiter
    r = backend.probe
    t = tag()
    undo = [Adjustment(f"{t}:tpm", -120, far_ms())]
    assert await lim.settle(f"{t}:req", undo, ledger_ttl_ms=TTL, cancel=True)
    assert (await r.counter(f"{t}:tpm") or 0) == 0  # nothing refunded that was never charged
    res = await lim.admit(
        AdmitCall(
            f"{t}:req", [tpm(t, 120)], tpm_charged=120, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    assert res.duplicate and (await r.counter(f"{t}:tpm") or 0) == 0


async def test_settlement_takes_back_an_unconfirmed_charge_that_ran(backend: Backend) -> None:
    """A stream charge timed out on our side but ran: the settlement, computed without it,
    takes it back, so the counter ends at what was delivered."""
    lim = backend.limiter
    r = backend.probe
    t = tag()
    await lim.admit(
        AdmitCall(f"{t}:req", [tpm(t, 10)], tpm_charged=10, count_refused=False, ledger_ttl_ms=TTL)
    )
    await lim.charge(f"{t}:req", 1, [tpm(t, 0)], 16, strict=False, ledger_ttl_ms=TTL)
    assert (await r.counter(f"{t}:tpm") or 0) == 26
    # the processor saw no answer: its account holds 10, it delivered 12 output tokens
    shortfall = [Adjustment(f"{t}:tpm", 12, far_ms())]
    ghost = UnconfirmedCharge(1, ((f"{t}:tpm", RATE_SCALE),))
    assert await lim.settle(f"{t}:req", shortfall, ledger_ttl_ms=TTL, unconfirmed=ghost)
    assert (await r.counter(f"{t}:tpm") or 0) == 10 + 12


async def test_a_charge_arriving_after_settlement_charges_nothing(backend: Backend) -> None:
    """The settlement reached Redis before the timed-out charge: the charge is a no-op and the
    settlement found nothing to take back."""
    lim = backend.limiter
    r = backend.probe
    t = tag()
    await lim.admit(
        AdmitCall(f"{t}:req", [tpm(t, 10)], tpm_charged=10, count_refused=False, ledger_ttl_ms=TTL)
    )
    ghost = UnconfirmedCharge(1, ((f"{t}:tpm", RATE_SCALE),))
    shortfall = [Adjustment(f"{t}:tpm", 12, far_ms())]
    assert await lim.settle(f"{t}:req", shortfall, ledger_ttl_ms=TTL, unconfirmed=ghost)
    got = await lim.charge(f"{t}:req", 1, [tpm(t, 0)], 16, strict=False, ledger_ttl_ms=TTL)
    assert got.granted == 0 and (await r.counter(f"{t}:tpm") or 0) == 22
