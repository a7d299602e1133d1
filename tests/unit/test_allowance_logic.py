"""The allowance wrapper's bookkeeping, on the in-memory limiter and a fake clock: what goes
back when (time up, window ended, near the limit), a stream charge whose answer was not waited
for, a settlement whose Redis part failed and is retried, and the key parsing it relies on."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from extproc.clock import FakeClock
from extproc.core.keys import counter_name
from extproc.core.rules import Adjustment, BucketCharge, UnconfirmedCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import AdmitCall, SettleCall
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics

pytestmark = pytest.mark.unit

TAG = "aiq:{t1}"
TPM = f"{TAG}:tpm:t:*:60:1"
RPM = f"{TAG}:rpm:t:*:60:1"
TTL = 60_000


def test_counter_name_reads_window_counters_only() -> None:
    name = counter_name("aiq:{acme}:tpm.sliding:k.key1:gpt-4o:60:29000000")
    assert name is not None
    assert (name.tag, name.metric, name.window_s) == ("aiq:{acme}", "tpm.sliding", 60)
    # a model with colons in its name
    assert counter_name("aiq:{a}:rpm:t:ollama:llama3:3600:12") is not None
    assert counter_name("aiq:{a}:conc:t:*") is None
    assert counter_name("aiq:{a}:req:abc") is None
    assert counter_name("no-tag") is None
    # a calendar month's key names the month, not a length: it lasts 31 days at most
    month = counter_name("aiq:{a}:tpm:t:*:0:m202612")
    assert month is not None and (month.window_s, month.longest_s) == (0, 31 * 86_400)
    assert counter_name(TPM) is not None and counter_name(TPM).longest_s == 60  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("max_window_s", "local"), [(3_600, False), (30 * 86_400, False), (31 * 86_400, True)]
)
async def test_a_calendar_month_takes_allowances_only_when_months_are_allowed(
    max_window_s: int, local: bool
) -> None:
    """A monthly TPM limit (its key's length 0) is judged at 31 days against
    ``max_window_s``: with the default hour it goes to the wrapped limiter every time (a
    killed replica's leak would last the month)."""
    clock = FakeClock()
    lim = AllowanceLimiter(
        MemoryLimiter(clock),
        AllowanceSettings(min_rate=2, max_window_s=max_window_s),
        clock=clock,
    )
    month = f"{TAG}:tpm:t:*:0:m202612"
    try:
        for n in range(40):
            bs = [BucketCharge(month, "tpm", 10, 10**9, clock.now_ms() + 86_400_000)]
            call = AdmitCall(
                f"{TAG}:req:{n}", bs, tpm_charged=10, count_refused=False, ledger_ttl_ms=TTL
            )
            assert (await lim.admit(call)).admitted
            await lim.settle_many([SettleCall(f"{TAG}:req:{n}", [], TTL)])
            clock.advance(0.02)
            for _ in range(3):
                await asyncio.sleep(0)  # the background take
    finally:
        await lim.close()
    assert (lim.stats.local_admissions > 0) is local


class Flaky(MemoryLimiter):
    """The in-memory limiter whose settlements fail while ``down``."""

    down = False

    async def settle_many(self, items: list[SettleCall]) -> list[bool | None]:
        if self.down:
            return [None] * len(items)
        return await super().settle_many(items)

    async def settle(
        self,
        ledger: str,
        adjustments: list[Adjustment],
        *,
        ledger_ttl_ms: int,
        cancel: bool = False,
        unconfirmed: UnconfirmedCharge | None = None,
    ) -> bool:
        if self.down:
            raise LimiterUnavailable("down (scripted)")
        return await super().settle(
            ledger, adjustments, ledger_ttl_ms=ledger_ttl_ms, cancel=cancel, unconfirmed=unconfirmed
        )


def setup(limit: int = 10**9) -> tuple[FakeClock, Flaky, AllowanceLimiter]:
    clock = FakeClock()
    store = Flaky(clock)
    lim = AllowanceLimiter(
        store, AllowanceSettings(min_rate=2, ttl_ms=2_000), clock=clock, metrics=Metrics()
    )
    return clock, store, lim


def charges(clock: FakeClock, amount: int, limit: int = 10**9) -> list[BucketCharge]:
    end = clock.now_ms() + 60_000
    return [
        BucketCharge(RPM, "rpm", 1, 10**9, end),
        BucketCharge(TPM, "tpm", amount, limit, end, refundable=amount),
    ]


async def admit(lim: AllowanceLimiter, n: int, bs: Sequence[BucketCharge]) -> bool:
    res = await lim.admit(
        AdmitCall(
            f"{TAG}:req:{n}",
            list(bs),
            tpm_charged=bs[1].amount,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    return res.admitted


async def warm(clock: FakeClock, lim: AllowanceLimiter, n: int = 6) -> None:
    """Admissions until the bucket holds allowances (their takes answered)."""
    for i in range(n):
        assert await admit(lim, 1000 + i, charges(clock, 100))
        await lim.settle_many([SettleCall(f"{TAG}:req:{1000 + i}", [], TTL)])
        for t in list(lim.book.tasks):
            await t
    assert lim.stats.taken > 0


async def test_an_allowance_nobody_draws_from_goes_back_after_its_time() -> None:
    clock, store, lim = setup()
    await warm(clock, lim)
    held = store.counter(TPM)
    assert held is not None and held > 600  # six requests and the allowance
    clock.advance(2.5)
    lim.sweep()
    await lim.returns.flush()
    assert store.counter(TPM) == 600
    assert lim.stats.returned > 0
    await lim.close()


async def test_an_allowance_whose_window_ended_is_dropped_not_returned() -> None:
    clock, _store, lim = setup()
    await warm(clock, lim)
    clock.advance(61)  # past the window's end (its counter expires with it)
    lim.sweep()
    assert lim.stats.expired > 0
    assert not lim.book.states  # forgotten
    assert lim.book.returns == []
    await lim.close()


async def test_a_local_charge_not_waited_for_is_put_back_at_settlement() -> None:
    clock, _store, lim = setup()
    await warm(clock, lim)
    led = f"{TAG}:req:s"
    bs = charges(clock, 100)
    assert (
        await lim.admit(AdmitCall(led, bs, tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL))
    ).admitted
    assert led in lim.book.ledgers  # admitted from the allowances
    tok = [BucketCharge(TPM, "tpm", 40, 10**9, bs[1].expire_at_ms)]
    assert (await lim.charge(led, 1, tok, 40, strict=False, ledger_ttl_ms=TTL)).granted == 40
    before = lim.book.states[TPM].units
    # settlement computed without charge 1 (its answer was not waited for): it comes back
    done = await lim.settle_many(
        [SettleCall(led, [], TTL, unconfirmed=UnconfirmedCharge(1, ((TPM, 1_000_000),)))]
    )
    assert done == [True]
    assert lim.book.states[TPM].units == before + 40
    await lim.close()


async def test_a_settlement_whose_redis_part_failed_is_applied_once_on_retry() -> None:
    clock, store, lim = setup()
    await warm(clock, lim)
    led = f"{TAG}:req:r"
    bs = charges(clock, 100)
    assert await admit(lim, 7, bs)
    assert (
        await lim.admit(AdmitCall(led, bs, tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL))
    ).admitted
    # a shortfall larger than the allowance holds goes to Redis
    short = Adjustment(TPM, lim.book.states[TPM].units + 5_000, bs[1].expire_at_ms)
    store.down = True
    assert await lim.settle_many([SettleCall(led, [short], TTL)]) == [None]
    store.down = False
    before = store.counter(TPM) or 0
    assert await lim.settle_many([SettleCall(led, [short], TTL)]) == [True]
    assert (store.counter(TPM) or 0) == before + short.amount
    # and never twice
    assert await lim.settle_many([SettleCall(led, [short], TTL)]) == [False]
    assert await lim.settle(led, [short], ledger_ttl_ms=TTL) is False
    assert (store.counter(TPM) or 0) == before + short.amount
    await lim.close()


async def test_near_the_limit_what_is_held_goes_back_and_takes_pause() -> None:
    clock, store, lim = setup()
    await warm(clock, lim)
    st = lim.book.states[TPM]
    assert st.units > 0
    returned, takes, local = lim.stats.returned, lim.stats.takes, lim.stats.local_admissions
    # other replicas brought the tenant near its limit (room 400 once this replica's allowance
    # is back and the request below admitted: a tenth is less than one request), and this
    # allowance's time is up: the next admission goes to Redis
    store.seed_counter(TPM, 10**9 - 500 + st.units, ttl_ms=60_000)
    st.deadline_ms = 0
    for n in range(3):
        assert await admit(lim, 99 + n, charges(clock, 100))
        for t in list(lim.book.tasks):
            await t
    assert st.units == 0  # given back (riding on that admission)
    assert lim.stats.returned > returned
    # the room Redis answered with is too small for a take: none is asked, all go to Redis
    assert lim.stats.takes == takes
    assert lim.stats.local_admissions == local
    await lim.close()


async def test_requests_never_settled_do_not_stop_allowances(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Modes that settle nothing leave their local requests unsettled: past the bound the
    oldest is forgotten, and admissions stay local."""
    import extproc.limiter.allowance.limiter as allowance

    monkeypatch.setattr(allowance, "MAX_LEDGERS", 5)
    clock, _store, lim = setup()
    await warm(clock, lim)
    local = lim.stats.local_admissions
    for n in range(10):  # never settled
        assert await admit(lim, 500 + n, charges(clock, 10))
    assert lim.stats.local_admissions == local + 10
    assert len(lim.book.ledgers) == 5
    await lim.close()


async def test_a_lease_lost_while_alive_never_lets_reclaimed_units_be_drawn_or_refunded_twice() -> (
    None
):
    """The allowance ledger's lease runs out while the replica lives (its renewals lost): the
    next admission reclaims the never-opened tranches; the replica's next take (a new ledger
    generation) or opening (refused) tells it, so it never draws from them, and its give-back
    refunds only what it still holds: the counter ends exactly at what the requests used."""
    LIMIT = 200_000  # noqa: N806  (room for a few tranches of a few thousand tokens)
    clock = FakeClock()
    store = MemoryLimiter(clock)
    lim = AllowanceLimiter(
        store,
        AllowanceSettings(min_rate=2, ttl_ms=60_000, lease_ms=1_000),
        clock=clock,
        metrics=Metrics(),
    )
    truth = 0
    for i in range(30):
        assert await admit(lim, 2000 + i, charges(clock, 100, LIMIT))
        await lim.settle_many([SettleCall(f"{TAG}:req:{2000 + i}", [], TTL)])
        truth += 100
        for t in list(lim.book.tasks):
            await t
        if lim.book.states[TPM].closed and lim.stats.local_admissions:
            break
    st = lim.book.states[TPM]
    closed, held = st.closed, st.units
    assert closed > 0
    assert store.counter(TPM) == truth + held
    clock.advance(1.5)  # the lease ran out, no renewal
    other = await store.admit(
        AdmitCall(
            f"{TAG}:req:other",
            charges(clock, 100, LIMIT),
            tpm_charged=100,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=clock.now_ms(),
        )
    )
    assert other.admitted and other.allowance_reclaimed >= closed
    truth += 100
    assert store.counter(TPM) == truth + held - closed
    # the replica goes on: its next take (a new ledger generation) or opening (refused) tells
    # it the old record is gone; it never draws from the reclaimed units
    old_gen = lim.book.leases[TAG].gen
    for n in range(60):
        assert await admit(lim, 3000 + n, charges(clock, 100, LIMIT))
        await lim.settle_many([SettleCall(f"{TAG}:req:{3000 + n}", [], TTL)])
        truth += 100
        for t in list(lim.book.tasks):
            await t
    await lim.returns.flush()
    assert lim.book.leases[TAG].gen != old_gen
    await lim.give_back()
    assert store.counter(TPM) == truth  # nothing drawn unpaid, nothing refunded twice
    await lim.close()
