"""The circuit breaker's state machine, driven by the fake clock."""

from __future__ import annotations

import pytest

from extproc.clock import FakeClock
from extproc.limiter.breaker import BreakerSettings, BreakerState, CircuitBreaker

pytestmark = pytest.mark.unit

SETTINGS = BreakerSettings(
    failure_rate=0.5, min_calls=10, window_s=2.0, buckets=10, open_s=1.0, probes=3
)


def state(b: CircuitBreaker) -> BreakerState:
    """The breaker's state now (a call: mypy would keep an earlier assert's narrowing)."""
    return b.state


def make() -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(clock, SETTINGS), clock


def calls(b: CircuitBreaker, ok: int, failed: int) -> None:
    for _ in range(ok):
        assert b.allow()
        b.record(True)
    for _ in range(failed):
        assert b.allow()
        b.record(False)


def test_one_failure_never_opens() -> None:
    """A single failed (or slow) call leaves the breaker closed, even as the only call."""
    b, _ = make()
    calls(b, 0, 1)
    assert state(b) is BreakerState.CLOSED
    assert b.allow()


def test_failures_below_min_calls_do_not_open() -> None:
    """Nine failures out of nine calls are fewer than min_calls: still closed."""
    b, _ = make()
    calls(b, 0, 9)
    assert state(b) is BreakerState.CLOSED


def test_rate_at_threshold_with_enough_calls_opens() -> None:
    """Ten calls with half of them failed open the breaker; calls then fail at once."""
    b, _ = make()
    calls(b, 5, 5)
    assert state(b) is BreakerState.OPEN
    assert not b.allow()


def test_rate_below_threshold_stays_closed() -> None:
    """Four failures in twelve calls (33 %) keep it closed."""
    b, _ = make()
    calls(b, 8, 4)
    assert state(b) is BreakerState.CLOSED


def test_old_failures_leave_the_window() -> None:
    """Failures older than the rolling window no longer count."""
    b, clock = make()
    calls(b, 0, 9)
    clock.advance(2.5)
    calls(b, 9, 1)
    assert state(b) is BreakerState.CLOSED
    assert b.window() == (10, 1)


def test_half_open_after_cool_down_lets_a_few_probes_through() -> None:
    """After open_s the breaker lets ``probes`` calls through at a time, refusing the rest."""
    b, clock = make()
    calls(b, 0, 10)
    assert state(b) is BreakerState.OPEN
    clock.advance(0.9)
    assert not b.allow()
    clock.advance(0.2)
    assert state(b) is BreakerState.HALF_OPEN
    assert [b.allow() for _ in range(4)] == [True, True, True, False]


def test_probe_successes_close_it() -> None:
    """``probes`` successful probes close the breaker with an empty window."""
    b, clock = make()
    calls(b, 0, 10)
    clock.advance(1.0)
    for _ in range(3):
        assert b.allow()
    for _ in range(3):
        b.record(True)
    assert state(b) is BreakerState.CLOSED
    assert b.window() == (0, 0)
    calls(b, 0, 1)
    assert state(b) is BreakerState.CLOSED


def test_a_failed_probe_reopens_for_another_cool_down() -> None:
    """One failed probe opens the breaker again for open_s from the failure."""
    b, clock = make()
    calls(b, 0, 10)
    clock.advance(1.0)
    assert b.allow()
    b.record(False)
    assert state(b) is BreakerState.OPEN
    clock.advance(0.5)
    assert not b.allow()
    clock.advance(0.6)
    assert state(b) is BreakerState.HALF_OPEN
    assert b.opened_count == 2


def test_an_abandoned_probe_frees_its_slot() -> None:
    """A probe cancelled before its outcome gives its slot back."""
    b, clock = make()
    calls(b, 0, 10)
    clock.advance(1.0)
    assert [b.allow() for _ in range(3)] == [True, True, True]
    assert not b.allow()
    b.abandon()
    assert b.allow()


def test_outcomes_of_calls_started_before_opening_change_nothing() -> None:
    """A late answer while open neither closes nor extends the open period."""
    b, clock = make()
    calls(b, 0, 10)
    b.record(True)
    b.record(False)
    assert state(b) is BreakerState.OPEN
    clock.advance(1.0)
    assert state(b) is BreakerState.HALF_OPEN


def test_configure_applies_new_settings() -> None:
    """A reload's settings apply at once: a higher min_calls needs more calls to open."""
    b, _ = make()
    b.configure(BreakerSettings(min_calls=30, open_s=2.0))
    calls(b, 0, 20)
    assert state(b) is BreakerState.CLOSED
    calls(b, 0, 10)
    assert state(b) is BreakerState.OPEN


def test_settings_reject_a_single_call_minimum() -> None:
    """min_calls below 2 would let one failure open the breaker: refused."""
    with pytest.raises(ValueError, match="min_calls"):
        BreakerSettings(min_calls=1)
