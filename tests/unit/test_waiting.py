"""The waiting rule (docs/semantics.md, "Waiting"): the pure rule (extproc.core.waiting) and,
by simulation on the in-memory limiter, its guarantees: never beyond a limit, never a refusal
that the window arithmetic could have served within the wait, served in arrival order, one
tenant's waiters never move another's outcome (tests/waiting_support.py; the same check runs
on the real admit.lua in tests/integration/test_waiting_scripts.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.clock import FakeClock
from extproc.config.wait_schema import WaitEntry
from extproc.core.waiting import (
    CONCURRENCY_POLL_MS,
    HOLD_TIMEOUT_MS,
    NEVER,
    Outcome,
    QueueBucket,
    WaitRule,
    decide,
    turn_ms,
    wait_kind,
)
from extproc.envoy_config import EnvoyPorts, render
from extproc.limiter.memory import MemoryLimiter
from tests.waiting_support import check, check_tokens, simulate

pytestmark = pytest.mark.unit


def fixed(value: int, limit: int, *, ahead: int = 0, amount: int = 1) -> QueueBucket:
    return QueueBucket(
        "fixed", value, amount, limit, ahead=ahead, window_end_ms=10_000, window_ms=10_000
    )


def test_room_for_everyone_ahead_and_the_request_admits() -> None:
    assert decide([fixed(0, 2, ahead=1)], 1000, 16_000).outcome is Outcome.ADMITTED
    # room for the request alone is not enough: the waiter ahead was promised it
    d = decide([fixed(1, 2, ahead=1)], 1000, 16_000)
    assert d.outcome is Outcome.WAIT and d.turn_ms == 10_000


def test_fixed_window_turns_spill_limit_per_window() -> None:
    # 2 per 10 s window, full: positions 0 and 1 at the next boundary, 2 and 3 one later
    assert [turn_ms(fixed(2, 2, ahead=p), 1000) for p in range(4)] == [
        10_000,
        10_000,
        20_000,
        20_000,
    ]
    # room for one in this window: the first waiter now, the next two at the boundary
    assert [turn_ms(fixed(1, 2, ahead=p), 1000) for p in range(3)] == [1000, 10_000, 10_000]


def test_beyond_the_deadline_is_refused_at_once_with_its_turn() -> None:
    d = decide([fixed(2, 2, ahead=2)], 1000, 16_000)
    assert d.outcome is Outcome.REFUSED and d.turn_ms == 20_000


def test_a_request_alone_over_the_limit_never_waits() -> None:
    d = decide([fixed(0, 10, amount=11)], 0, 60_000)
    assert d == decide([fixed(0, 10, amount=11)], 0, 60_000)
    assert d.outcome is Outcome.REFUSED and d.turn_ms == NEVER


def test_budgets_refuse_at_once_rates_wait() -> None:
    budget = QueueBucket("none", 100, 5, 100)
    d = decide([fixed(2, 2), budget], 0, 60_000)
    assert d.outcome is Outcome.REFUSED and d.budget
    # a budget with room does not stop the wait, and waiters ahead do not count in it
    roomy = QueueBucket("none", 90, 5, 100, ahead=50)
    assert decide([fixed(2, 2), roomy], 0, 60_000).outcome is Outcome.WAIT
    assert wait_kind("tpm", 86_400, sliding=False, period=None) == "none"
    assert wait_kind("cost", 60, sliding=False, period=None) == "none"
    assert wait_kind("rpm", 60, sliding=True, period=None) == "sliding"
    assert wait_kind("tpm", 3600, sliding=False, period="hour") == "none"
    assert wait_kind("concurrency", 0, sliding=False, period=None) == "concurrency"


def test_sliding_turn_inside_and_beyond_the_window() -> None:
    # limit 10, current 4, previous 10 (weight now 0.5): value 9, no room for 2
    b = QueueBucket(
        "sliding", 9, 2, 10, window_end_ms=10_000, window_ms=10_000, current=4, previous=10
    )
    # the limiter floors the previous window's weight (ppm) and share: room when
    # floor(10 x floor((10000 - t) x 100) / 1e6) <= 4, from t = 5001
    assert turn_ms(b, 5000) == 5001
    # 8 ahead: 6 of them fit in this window as the share falls (the last at 9001), 2 in the
    # next one (at 10001 and 11001, the previous window now 10), then this one's 2 at 13001
    b8 = QueueBucket(
        "sliding",
        9,
        2,
        10,
        ahead=8,
        window_end_ms=10_000,
        window_ms=10_000,
        current=4,
        previous=10,
    )
    assert turn_ms(b8, 5000) == 13_001


def test_concurrency_polls_until_the_deadline() -> None:
    c = QueueBucket("concurrency", 2, 1, 2)
    d = decide([c], 1000, 5000)
    assert d.outcome is Outcome.WAIT and d.turn_ms == 1000 + CONCURRENCY_POLL_MS
    # the last look is at the deadline itself; at the deadline, refused
    assert decide([c], 4900, 5000) == decide([c], 4900, 5000)
    assert decide([c], 4900, 5000).turn_ms == 5000
    assert decide([c], 5000, 5000).outcome is Outcome.REFUSED


def test_cap_refuses_newcomers_not_ticket_holders() -> None:
    b = fixed(2, 2, ahead=3)
    assert decide([b], 0, 60_000, queued=3, cap=3).outcome is Outcome.REFUSED
    assert decide([b], 0, 60_000, queued=3, cap=3, ticketed=True).outcome is Outcome.WAIT


def test_priority_header_within_the_plan() -> None:
    r = WaitRule(15_000, priority=1, max_priority=3)
    assert r.priority_for(None) == 1
    assert r.priority_for("2") == 2
    assert r.priority_for("9") == 3
    assert r.priority_for("x") == 1
    assert WaitRule(15_000, priority=1).priority_for("3") == 1  # the plan allows no header


_REQUESTS = st.lists(
    st.tuples(st.sampled_from(["wa", "wb", "wc"]), st.integers(0, 40_000)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=_REQUESTS,
    limit=st.integers(1, 3),
    window_s=st.sampled_from([1, 5, 10]),
    max_wait_ms=st.sampled_from([0, 999, 5000, 15_000]),
    base=st.integers(0, 30_000),
)
def test_simulated_waiting_is_the_ideal_schedule(
    reqs: list[tuple[str, int]], limit: int, window_s: int, max_wait_ms: int, base: int
) -> None:
    start = 1_900_000_000_000 + base
    requests = [(t, start + at) for t, at in reqs]
    lim = MemoryLimiter(FakeClock(start))
    got = asyncio.run(
        simulate(lim, requests, limit=limit, window_s=window_s, max_wait_ms=max_wait_ms, run="m")
    )
    check(requests, got, limit=limit, window_s=window_s, max_wait_ms=max_wait_ms)
    assert not any(lim.waiting.queues.values())  # every ticket gone: admitted or refused


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(st.sampled_from(["wa", "wb"]), st.integers(0, 30_000), st.integers(1, 1200)),
        min_size=1,
        max_size=25,
    ),
    window_s=st.sampled_from([1, 5, 10]),
    max_wait_ms=st.sampled_from([0, 5000, 15_000]),
)
def test_simulated_token_waits_stay_within_the_limit_and_the_deadline(
    reqs: list[tuple[str, int, int]], window_s: int, max_wait_ms: int
) -> None:
    start = 1_900_000_000_000
    requests = [(t, start + at) for t, at, _ in reqs]
    tokens = [n for _, _, n in reqs]
    lim = MemoryLimiter(FakeClock(start))
    got = asyncio.run(
        simulate(
            lim,
            requests,
            limit=1000,
            window_s=window_s,
            max_wait_ms=max_wait_ms,
            run="t",
            tokens=tokens,
        )
    )
    check_tokens(requests, tokens, got, limit=1000, window_s=window_s, max_wait_ms=max_wait_ms)
    assert not any(lim.waiting.queues.values())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(st.sampled_from(["wa", "wb"]), st.integers(0, 30_000), st.integers(1, 3)),
        min_size=1,
        max_size=25,
    ),
    limit=st.integers(1, 3),
    window_s=st.sampled_from([1, 5, 10]),
    max_wait_ms=st.sampled_from([0, 999, 5000, 15_000]),
    tpm=st.booleans(),
)
def test_simulated_sliding_waiting_is_the_ideal_schedule(
    reqs: list[tuple[str, int, int]], limit: int, window_s: int, max_wait_ms: int, tpm: bool
) -> None:
    start = 1_900_000_000_000
    requests = [(t, start + at) for t, at, _ in reqs]
    tokens = [n for _, _, n in reqs] if tpm else []
    lim = MemoryLimiter(FakeClock(start))
    kw: dict[str, Any] = {
        "limit": limit,
        "window_s": window_s,
        "max_wait_ms": max_wait_ms,
        "tokens": tokens,
    }
    got = asyncio.run(simulate(lim, requests, run="s", sliding=True, **kw))
    check(requests, got, sliding=True, **kw)
    assert not any(lim.waiting.queues.values())


def _walk(node: object, key: str) -> list[object]:
    """Every value under ``key`` anywhere in a rendered config."""
    found: list[object] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                found.append(v)
            found += _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            found += _walk(v, key)
    return found


def test_envoy_lets_the_longest_wait_through() -> None:
    """The hold asks Envoy for HOLD_TIMEOUT_MS, which max_message_timeout must allow (Envoy
    ignores a larger override); the longest wait and its last call fit in it, and under the
    listener's stream_idle_timeout; the committed bootstrap says the same."""
    cfg = render(EnvoyPorts())
    (mmt,) = _walk(cfg, "max_message_timeout")
    assert mmt == f"{HOLD_TIMEOUT_MS // 1000}s"
    longest = WaitEntry.model_fields["max_seconds"].metadata
    le = next(m.le for m in longest if hasattr(m, "le"))
    (idle,) = _walk(cfg, "stream_idle_timeout")
    assert le * 1000 + 5000 <= HOLD_TIMEOUT_MS <= int(str(idle).removesuffix("s")) * 1000
    committed = Path(__file__).resolve().parents[2] / "envoy" / "envoy.yaml"
    assert f"max_message_timeout: {mmt}" in committed.read_text()
