"""The batched-settlement backlog's decisions (sans-IO): when a batch goes, what a failure puts
back and when it is retried, what a full backlog drops."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.rules import Adjustment
from extproc.limiter.base import SettleCall
from extproc.limiter.batch import Backlog, Batcher, BatchSettings, Outcome

pytestmark = pytest.mark.unit


def s(i: int) -> SettleCall:
    return SettleCall(f"t:{{a}}:req:{i}", [Adjustment("t:{a}:tpm", -i, 1)], 60_000)


def ledgers(items: list[SettleCall]) -> list[str]:
    return [x.ledger for x in items]


def test_first_settlement_waits_one_tick_for_others() -> None:
    """Nothing goes before a tick has passed since the first settlement; then all go at once."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.01))
    b.add(s(1), 100.0)
    b.add(s(2), 100.005)
    assert b.next_send_at() == pytest.approx(100.01)
    assert b.take(100.009) == []
    assert ledgers(b.take(100.01)) == ledgers([s(1), s(2)])
    assert b.next_send_at() is None  # in flight: nothing else is sent
    assert [o.result for o in b.finish([True, False], 100.02)] == [True, False]
    assert len(b) == 0 and b.next_send_at() is None


def test_batches_are_capped_and_the_rest_goes_at_once() -> None:
    """More than max_batch waiting: the first call takes max_batch, the rest is due right after."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.01, max_batch=3, max_backlog=10))
    for i in range(5):
        b.add(s(i), 0.0)
    first = b.take(0.01)
    assert ledgers(first) == ledgers([s(0), s(1), s(2)])
    b.finish([True] * 3, 0.02)
    assert b.next_send_at() == 0.02
    assert ledgers(b.take(0.02)) == ledgers([s(3), s(4)])


def test_arrivals_during_a_call_go_right_after_it() -> None:
    """What arrives while a batch is in flight is sent when it returns, without a new tick."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.01))
    b.add(s(1), 0.0)
    b.take(0.01)
    b.add(s(2), 0.012)
    assert b.next_send_at() is None
    b.finish([True], 0.015)
    assert b.next_send_at() == 0.015
    assert ledgers(b.take(0.015)) == [s(2).ledger]


def test_failed_items_return_to_the_front_in_order_with_a_doubling_backoff() -> None:
    """Unsettled items go back before newer ones; each consecutive failure doubles the wait up
    to the maximum, and a success resets it."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.0, backoff_s=0.1, max_backoff_s=0.3))
    b.add(s(1), 0.0)
    b.add(s(2), 0.0)
    b.take(0.0)
    b.add(s(3), 0.0)
    done = b.finish([None, True], 1.0)  # the call settled s(2) but not s(1)
    assert ledgers([o.item for o in done]) == [s(2).ledger]
    assert b.failures == 1 and b.next_send_at() == pytest.approx(1.1)
    assert b.take(1.05) == []
    assert ledgers(b.take(1.1)) == ledgers([s(1), s(3)])
    b.fail(2.0)
    assert b.next_send_at() == pytest.approx(2.2)
    b.take(2.2)
    b.fail(3.0)
    assert b.next_send_at() == pytest.approx(3.3)  # capped at max_backoff_s
    assert ledgers(b.take(3.3)) == ledgers([s(1), s(3)])
    b.finish([True, True], 4.0)
    assert b.failures == 0 and len(b) == 0


def test_a_full_backlog_drops_nothing_and_says_it_is_full() -> None:
    """Issue 23, defect 6: at max_backlog nothing is dropped (the gateway pushes back on
    admissions instead); every settlement added is still there, in order."""
    b = Backlog[SettleCall, bool](BatchSettings(max_batch=2, max_backlog=3))
    for i in range(2):
        b.add(s(i), 0.0)
    assert not b.full
    for i in range(2, 5):
        b.add(s(i), 0.0)
    assert b.full and len(b) == 5
    assert ledgers(b.drain()) == ledgers([s(i) for i in range(5)])
    assert len(b) == 0 and not b.full


def test_drain_returns_in_flight_and_waiting_items() -> None:
    """On shutdown, the batch in flight and the waiting ones are all handed back."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.0))
    b.add(s(1), 0.0)
    b.take(0.0)
    b.add(s(2), 0.0)
    assert ledgers(b.drain()) == ledgers([s(1), s(2)])


def test_result_count_must_match_the_batch() -> None:
    """A settler answering for the wrong number of items is a clear error, not a silent loss."""
    b = Backlog[SettleCall, bool]()
    b.add(s(1), 0.0)
    b.take(1.0)
    with pytest.raises(ValueError, match="2 results for a batch of 1"):
        b.finish([True, True], 1.0)
    with pytest.raises(RuntimeError, match="without a batch"):
        Backlog[SettleCall, bool]().finish([], 0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tick_s": -1.0}, "tick_s"),
        ({"ride_s": -0.5}, "ride_s"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": 10, "max_backlog": 5}, "max_backlog"),
        ({"backoff_s": 0.0}, "backoff_s"),
        ({"backoff_s": 3.0, "max_backoff_s": 2.0}, "backoff_s"),
    ],
)
def test_settings_reject_nonsense(kwargs: dict[str, float], message: str) -> None:
    """Negative ticks, empty batches, a backlog smaller than a batch, bad backoffs are refused."""
    with pytest.raises(ValueError, match=message):
        BatchSettings(**kwargs)  # type: ignore[arg-type]


async def test_batcher_retries_a_call_that_raised_and_reports_each_item_once() -> None:
    """A send that raises (a bug, not Redis) is retried after the backoff; every item is then
    reported exactly once, in order, and a callback that raises does not stop the others."""
    calls: list[list[str]] = []

    async def send(batch: list[SettleCall]) -> list[bool | None]:
        calls.append(ledgers(batch))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [True] * len(batch)

    seen: list[str] = []

    def on_result(o: Outcome[SettleCall, bool]) -> None:
        seen.append(o.item.ledger)
        if o.item.ledger == s(1).ledger:
            raise ValueError("a broken callback")

    b: Batcher[SettleCall, bool] = Batcher(
        send, BatchSettings(tick_s=0.0, backoff_s=0.01), on_result=on_result
    )
    for i in range(3):
        b.submit(s(i))
    assert await b.wait_idle(5.0)
    assert calls == [ledgers([s(0), s(1), s(2)])] * 2
    assert seen == ledgers([s(0), s(1), s(2)])
    assert b.backlog.failures == 0
    assert await b.close(1.0) == []


async def test_batcher_hands_back_what_was_never_taken_on_close() -> None:
    """Redis never answers: close() returns every item submitted, beyond the backlog limit
    too (none was dropped)."""

    async def send(batch: list[SettleCall]) -> list[bool | None]:
        return [None] * len(batch)

    b: Batcher[SettleCall, bool] = Batcher(
        send, BatchSettings(tick_s=0.0, max_batch=2, max_backlog=3, backoff_s=0.01)
    )
    for i in range(5):
        b.submit(s(i))
    left = await b.close(0.1)
    assert sorted(ledgers(left)) == sorted(ledgers([s(i) for i in range(5)]))


def test_steal_takes_matching_waiting_items_oldest_first_and_counts_them() -> None:
    """steal() removes only waiting items the predicate accepts, up to its limit, oldest first;
    the others keep their order, and the riders still count in len()."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.01))
    for i in range(6):
        b.add(s(i), 0.0)
    odd = b.steal(lambda c: int(c.ledger.rsplit(":", 1)[1]) % 2 == 1, 2)
    assert ledgers(odd) == ledgers([s(1), s(3)])
    assert len(b) == 6 and b.riding == 2 and b.waiting == 4
    assert ledgers(b.take(0.01)) == ledgers([s(0), s(2), s(4), s(5)])


def test_steal_never_takes_in_flight_items_and_honours_scan() -> None:
    """An in-flight batch is not stolen from; ``scan`` bounds how far the queue is searched."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.0))
    b.add(s(0), 0.0)
    b.take(0.0)
    for i in range(1, 5):
        b.add(s(i), 0.0)
    assert b.steal(lambda c: c.ledger == s(4).ledger, 5, scan=3) == []
    assert ledgers(b.steal(lambda c: True, 10)) == ledgers([s(1), s(2), s(3), s(4)])
    assert b.waiting == 0 and len(b) == 5 and b.next_send_at() is None


def test_riders_back_report_taken_and_requeue_the_rest_at_the_front() -> None:
    """ridden(): answered riders become outcomes; unanswered ones go back to the front, in
    order, due at once, ahead of what arrived meanwhile."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.5))
    for i in range(3):
        b.add(s(i), 0.0)
    riders = b.steal(lambda c: True, 3)
    assert b.next_send_at() is None  # nothing waits: no batch is due
    b.add(s(9), 0.1)
    done = b.ridden(riders, [True, None, None], 0.2)
    assert [(o.item.ledger, o.result) for o in done] == [(s(0).ledger, True)]
    assert b.riding == 0 and len(b) == 3
    assert b.next_send_at() == 0.2
    assert ledgers(b.take(0.2)) == ledgers([s(1), s(2), s(9)])


def test_riders_back_keep_a_backoff_in_force() -> None:
    """Riders put back while the batch is backing off after a failure wait for that backoff."""
    b = Backlog[SettleCall, bool](BatchSettings(tick_s=0.0, backoff_s=1.0, max_backoff_s=1.0))
    b.add(s(0), 0.0)
    b.add(s(1), 0.0)
    b.take(0.0)
    b.fail(0.0)  # both back, due at 1.0
    riders = b.steal(lambda c: c.ledger == s(1).ledger, 1)
    b.ridden(riders, [None], 0.5)
    assert b.next_send_at() == 1.0
    assert ledgers(b.take(1.0)) == ledgers([s(1), s(0)])


def test_ridden_checks_its_input() -> None:
    """More riders back than were out, or a result count that does not match, is a bug."""
    b = Backlog[SettleCall, bool]()
    b.add(s(0), 0.0)
    riders = b.steal(lambda c: True, 1)
    with pytest.raises(ValueError, match="1 riders"):
        b.ridden(riders, [], 0.0)
    with pytest.raises(RuntimeError, match="riders back"):
        b.ridden([s(0), s(1)], [True, True], 0.0)


async def test_batcher_waits_for_riders_before_idle_and_resends_failed_ones() -> None:
    """While riders are out the batcher is not idle; riders whose call failed are sent by the
    batcher itself; every item is reported once."""
    sent: list[list[str]] = []

    async def send(batch: list[SettleCall]) -> list[bool | None]:
        sent.append(ledgers(batch))
        return [True] * len(batch)

    seen: list[str] = []
    b: Batcher[SettleCall, bool] = Batcher(
        send, BatchSettings(tick_s=60.0), on_result=lambda o: seen.append(o.item.ledger)
    )
    for i in range(3):
        b.submit(s(i))
    riders = b.take_riders(lambda c: True, 2)
    assert ledgers(riders) == ledgers([s(0), s(1)])
    assert not await b.wait_idle(0.01)
    b.riders_back(riders, None)  # the admission carrying them failed
    more = b.take_riders(lambda c: True, 5)
    assert ledgers(more) == ledgers([s(0), s(1), s(2)])
    b.riders_back(more, [True, False, None])
    assert await b.wait_idle(5.0)  # s(2) was due at once: the batcher sent it alone
    assert sent == [[s(2).ledger]]
    assert sorted(seen) == sorted(ledgers([s(0), s(1), s(2)]))
    with pytest.raises(RuntimeError, match="not riding"):
        b.riders_back([s(0)], [True])
    assert await b.close(1.0) == []
    assert b.take_riders(lambda c: True, 5) == []


async def test_close_reports_riders_still_out() -> None:
    """A drain that ends while riders are inside another call lists them as not confirmed."""

    async def send(batch: list[SettleCall]) -> list[bool | None]:
        return [True] * len(batch)

    b: Batcher[SettleCall, bool] = Batcher(send, BatchSettings(tick_s=60.0))
    b.submit(s(0))
    riders = b.take_riders(lambda c: True, 1)
    assert ledgers(await b.close(0.05)) == [s(0).ledger]
    b.riders_back(riders, [True])  # answered late: nothing breaks
    assert len(b) == 0


async def test_close_sends_what_waits_without_waiting_for_the_tick() -> None:
    """close() sends waiting items at once, though their tick is far off."""
    sent: list[str] = []

    async def send(batch: list[SettleCall]) -> list[bool | None]:
        sent.extend(ledgers(batch))
        return [True] * len(batch)

    b: Batcher[SettleCall, bool] = Batcher(send, BatchSettings(tick_s=3600.0))
    b.submit(s(0))
    await asyncio.sleep(0)  # the sender task is asleep until the tick
    assert await b.close(5.0) == []
    assert sent == [s(0).ledger]


def test_a_settlement_waits_longer_for_a_ride_only_while_admissions_come() -> None:
    """With ride_s, the first settlement waits ride_s when two admissions started within it or
    other requests are in progress (busy); with neither, one tick, as without riders."""
    settings = BatchSettings(tick_s=0.002, ride_s=0.02)
    idle = Backlog[SettleCall, bool](settings)
    idle.saw_admission(0.0)  # one admission: its own
    idle.add(s(0), 0.005)
    assert idle.next_send_at() == pytest.approx(0.007)
    assert not idle.flowing(0.005)

    flowing = Backlog[SettleCall, bool](settings)
    flowing.saw_admission(0.0)
    flowing.saw_admission(0.004)
    assert flowing.flowing(0.01) and not flowing.flowing(0.021)
    flowing.add(s(0), 0.01)
    assert flowing.next_send_at() == pytest.approx(0.03)

    stale = Backlog[SettleCall, bool](settings)
    stale.saw_admission(0.0)
    stale.saw_admission(0.004)
    stale.add(s(0), 0.05)  # the admissions stopped: no ride expected
    assert stale.next_send_at() == pytest.approx(0.052)

    busy = Backlog[SettleCall, bool](settings)
    busy.add(s(0), 1.0, busy=True)
    assert busy.next_send_at() == pytest.approx(1.02)

    off = Backlog[SettleCall, bool](BatchSettings(tick_s=0.002))
    off.saw_admission(0.0)
    off.saw_admission(0.001)
    off.add(s(0), 0.002, busy=True)
    assert off.next_send_at() == pytest.approx(0.004)
