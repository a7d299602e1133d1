"""Waiting on every backend (the in-memory limiter, admit.lua on Redis and on a three-node
Cluster): the simulated schedule equals the window arithmetic's (tests/waiting_support.py),
a ticket leaves at once when its request goes away (leave.lua), a dead processor's ticket
lapses with its lease and no longer holds anyone back, a tenant's cap refuses newcomers, a
journal replay of a waiting admission takes no ticket, and a level's (team's) RPM waits like a
plan's, each tenant's queue counting only its own waiters (docs/semantics.md "Waiting")."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import pytest

from extproc.core.admission_plan import admission_charges, buckets_for, compute_cost
from extproc.core.keys import ledger_key, tenant_tag
from extproc.core.rules import Charging, Limit
from extproc.core.waiting import (
    CONCURRENCY_POLL_MS,
    TICKET_LEASE_MS,
    QueueCall,
    bucket_kinds,
    queue_keys,
)
from extproc.limiter import layout
from extproc.limiter.base import AdmitCall, AdmitResult
from extproc.limiter.memory import MemoryLimiter
from tests.limiters import Backend
from tests.waiting_support import PREFIX, check, check_tokens, simulate

pytestmark = pytest.mark.integration

_LIMIT = Limit("rpm", 2, 10, "*", "tenant")
_COST = compute_cost(input_tokens=1, per_choice_max=0, n=1, stream=False, charging=Charging())


async def _queued(backend: Backend, key: str) -> int:
    if isinstance(backend.limiter, MemoryLimiter):
        return len(backend.limiter.waiting.queues.get(key, {}))
    return await backend.probe.members(key)


def _call(
    tenant: str,
    name: str,
    now: int,
    arrival: int,
    *,
    cap: int = 0,
    offset_ms: int = 0,
    limit: Limit = _LIMIT,
    lease_ms: int = 0,
) -> AdmitCall:
    bs = buckets_for(
        prefix=PREFIX, tenant=tenant, key_name="k", model="*", limits=(limit,), now_ms=now
    )
    return AdmitCall(
        ledger_key(PREFIX, tenant, name),
        admission_charges(bs, _COST),
        tpm_charged=1,
        count_refused=False,
        ledger_ttl_ms=600_000,
        now_ms=now,
        lease_until_ms=now + lease_ms if lease_ms else 0,
        queue=QueueCall(
            queue_keys(tenant_tag(PREFIX, tenant), tenant),
            offset_ms,
            arrival + 15_000,
            bucket_kinds(bs),
            cap=cap,
        ),
    )


def _window_start() -> int:
    """The start of a 10 s window a little ahead of now (keys expire by Redis's clock)."""
    return (int(time.time() * 1000) // 10_000 + 1) * 10_000


@pytest.mark.parametrize("seed", range(4))
async def test_the_schedule_is_the_window_arithmetics(backend: Backend, seed: int) -> None:
    rnd = random.Random(seed)
    start = int(time.time() * 1000) + rnd.randrange(10_000)
    tenants = [f"w{uuid.uuid4().hex[:6]}" for _ in range(3)]
    requests = sorted(
        ((rnd.choice(tenants), start + rnd.randrange(30_000)) for _ in range(40)),
        key=lambda r: r[1],
    )
    limit, window_s, max_wait = rnd.choice([1, 2, 3]), rnd.choice([1, 5, 10]), 15_000
    got = await simulate(
        backend.limiter,
        requests,
        limit=limit,
        window_s=window_s,
        max_wait_ms=max_wait,
        run=f"s{seed}",
    )
    check(requests, got, limit=limit, window_s=window_s, max_wait_ms=max_wait)
    for t in tenants:
        assert await _queued(backend, queue_keys(tenant_tag(PREFIX, t), t)[0]) == 0


@pytest.mark.parametrize("seed", range(3))
async def test_token_waits_stay_within_the_limit_and_the_deadline(
    backend: Backend, seed: int
) -> None:
    rnd = random.Random(100 + seed)
    start = int(time.time() * 1000) + rnd.randrange(10_000)
    tenants = [f"w{uuid.uuid4().hex[:6]}" for _ in range(2)]
    reqs = sorted(
        (
            (rnd.choice(tenants), start + rnd.randrange(30_000), rnd.randrange(1, 1200))
            for _ in range(30)
        ),
        key=lambda r: r[1],
    )
    requests = [(t, at) for t, at, _ in reqs]
    tokens = [n for _, _, n in reqs]
    window_s = rnd.choice([1, 5, 10])
    got = await simulate(
        backend.limiter,
        requests,
        limit=1000,
        window_s=window_s,
        max_wait_ms=15_000,
        run=f"t{seed}",
        tokens=tokens,
    )
    check_tokens(requests, tokens, got, limit=1000, window_s=window_s, max_wait_ms=15_000)
    for t in tenants:
        assert await _queued(backend, queue_keys(tenant_tag(PREFIX, t), t)[0]) == 0


@pytest.mark.parametrize("seed", range(4))
async def test_sliding_windows_serve_the_ideal_schedule(backend: Backend, seed: int) -> None:
    rnd = random.Random(200 + seed)
    start = int(time.time() * 1000) + rnd.randrange(10_000)
    tenants = [f"w{uuid.uuid4().hex[:6]}" for _ in range(2)]
    requests = sorted(
        ((rnd.choice(tenants), start + rnd.randrange(30_000)) for _ in range(30)),
        key=lambda r: r[1],
    )
    limit, window_s = rnd.choice([1, 3, 7]), rnd.choice([1, 5, 10])
    tokens = [rnd.randrange(1, limit + 2) for _ in requests] if seed % 2 else []
    kw: dict[str, Any] = {
        "limit": limit,
        "window_s": window_s,
        "max_wait_ms": 15_000,
        "tokens": tokens,
    }
    got = await simulate(backend.limiter, requests, run=f"sl{seed}", sliding=True, **kw)
    check(requests, got, sliding=True, **kw)
    for t in tenants:
        assert await _queued(backend, queue_keys(tenant_tag(PREFIX, t), t)[0]) == 0


async def test_a_ticket_leaves_at_once_and_a_dead_ones_lapses(backend: Backend) -> None:
    lim, t0 = backend.limiter, _window_start()
    tenant = f"w{uuid.uuid4().hex[:6]}"
    q = queue_keys(tenant_tag(PREFIX, tenant), tenant)
    for n in ("a", "b"):
        assert (await lim.admit(_call(tenant, n, t0, t0))).admitted
    waits: dict[str, AdmitResult] = {}
    for n in ("c", "d", "e"):
        waits[n] = await lim.admit(_call(tenant, n, t0 + 1, t0 + 1))
    assert [waits[n].wait for n in "cde"] == [True, True, False]  # e: its turn is t0 + 20 s
    assert waits["c"].turn_ms == waits["d"].turn_ms == t0 + 10_000
    assert waits["e"].turn_ms == t0 + 20_000
    assert await _queued(backend, q[0]) == 2
    # c's client hangs up: its ticket goes at once; a newcomer takes its place in the window
    assert await lim.leave_queue(ledger_key(PREFIX, tenant, "c"), q)
    assert not await lim.leave_queue(ledger_key(PREFIX, tenant, "c"), q)  # idempotent
    f = await lim.admit(_call(tenant, "f", t0 + 2, t0 + 2))
    assert f.wait and f.turn_ms == t0 + 10_000
    # d's processor dies: nobody asks at d's turn; f, asking then, is admitted (room for both)
    assert (await lim.admit(_call(tenant, "f", t0 + 10_000, t0 + 2))).admitted
    # a newcomer after d's lease ran out no longer counts d ahead of it
    late = t0 + 10_000 + TICKET_LEASE_MS + 1
    g = await lim.admit(_call(tenant, "g", late, late))
    assert g.admitted, g
    assert await _queued(backend, q[0]) == 0


async def test_the_tenants_cap_refuses_newcomers(backend: Backend) -> None:
    lim, t0 = backend.limiter, _window_start()
    tenant = f"w{uuid.uuid4().hex[:6]}"
    for n in ("a", "b"):
        assert (await lim.admit(_call(tenant, n, t0, t0, cap=1))).admitted
    assert (await lim.admit(_call(tenant, "c", t0 + 1, t0 + 1, cap=1))).wait
    full = await lim.admit(_call(tenant, "d", t0 + 2, t0 + 2, cap=1))
    assert not full.admitted and not full.wait and full.queue_full
    # the ticket holder still is served
    assert (await lim.admit(_call(tenant, "c", t0 + 10_000, t0 + 1, cap=1))).admitted


async def test_a_teams_limit_waits_but_tenants_are_not_ordered_with_each_other(
    backend: Backend,
) -> None:
    """Two tenants of one organisation share a team's 2 per 10 s.  A's two waiters and B's
    newcomer are all told the next window (B's queue does not hold A's waiters); at that turn
    two are admitted, never beyond the team's limit, and the third, whose new turn is past its
    15 s wait, is refused after waiting."""
    lim, t0 = backend.limiter, _window_start()
    org = f"o{uuid.uuid4().hex[:6]}"
    a, b = f"@o.{org}/a", f"@o.{org}/b"
    team = Limit("rpm", 2, 10, "*", "team", owner="tm")
    for n in ("a1", "a2"):
        assert (await lim.admit(_call(a, n, t0, t0, limit=team))).admitted
    turns = []
    for tenant, n in ((a, "a3"), (a, "a4"), (b, "b1")):
        res = await lim.admit(_call(tenant, n, t0 + 100, t0 + 100, limit=team))
        assert res.wait and not res.admitted, (n, res)
        turns.append(res.turn_ms)
    assert turns == [t0 + 10_000] * 3  # ordered within A only: B is told the same turn
    # the turn: b1 asks first and is admitted; a3 too; a4's next turn (t0 + 20 s) is past
    # its deadline (t0 + 15.1 s): refused after waiting
    got = {}
    for tenant, n in ((b, "b1"), (a, "a3"), (a, "a4")):
        got[n] = await lim.admit(_call(tenant, n, t0 + 10_000, t0 + 100, limit=team))
    assert got["b1"].admitted and got["a3"].admitted
    assert not got["a4"].admitted and not got["a4"].wait
    assert got["a4"].turn_ms == t0 + 20_000
    for tenant in (a, b):
        assert await _queued(backend, queue_keys(tenant_tag(PREFIX, tenant), tenant)[0]) == 0


def test_a_replay_takes_no_ticket() -> None:
    call = _call("wt", "r", 1_900_000_000_000, 1_900_000_000_000)
    packed = layout.admission(call)
    replay = packed.replay()
    assert replay[-1] == 0 and len(replay) == packed.queue_at + 1
    assert packed.args[-1] == len(packed.args) - 1 - packed.queue_at


async def test_a_higher_class_goes_ahead_of_one_that_came_within_its_boost(
    backend: Backend,
) -> None:
    lim, t0 = backend.limiter, _window_start()
    tenant = f"w{uuid.uuid4().hex[:6]}"
    one = Limit("rpm", 1, 10, "*", "tenant")
    assert (await lim.admit(_call(tenant, "a", t0, t0, limit=one))).admitted
    b = await lim.admit(_call(tenant, "b", t0 + 1, t0 + 1, limit=one))
    assert b.wait and b.turn_ms == t0 + 10_000
    # c comes later, a class higher (worth 5 s): it queues ahead of b, its turn is b's
    c = await lim.admit(_call(tenant, "c", t0 + 2, t0 + 2, limit=one, offset_ms=5000))
    assert c.wait and c.turn_ms == t0 + 10_000
    # a class-0 newcomer queues behind both
    d = await lim.admit(_call(tenant, "d", t0 + 3, t0 + 3, limit=one))
    assert not d.admitted and not d.wait and d.turn_ms == t0 + 30_000  # beyond 15 s: refused
    # at the boundary b, asking first, finds c ahead: its turn is now the next boundary,
    # past its deadline (the cost of a higher class: docs/semantics.md, "Waiting"): refused
    b2 = await lim.admit(_call(tenant, "b", t0 + 10_000, t0 + 1, limit=one))
    assert not b2.admitted and not b2.wait and b2.turn_ms == t0 + 20_000
    assert (await lim.admit(_call(tenant, "c", t0 + 10_000, t0 + 2, limit=one))).admitted
    assert await _queued(backend, queue_keys(tenant_tag(PREFIX, tenant), tenant)[0]) == 0


async def test_concurrency_waits_for_a_slot(backend: Backend) -> None:
    lim, t0 = backend.limiter, _window_start()
    tenant = f"w{uuid.uuid4().hex[:6]}"
    slot = Limit("concurrency", 1, 0, "*", "tenant")
    a = _call(tenant, "a", t0, t0, limit=slot, lease_ms=60_000)
    assert (await lim.admit(a)).admitted
    b = await lim.admit(_call(tenant, "b", t0 + 1, t0 + 1, limit=slot, lease_ms=60_000))
    assert b.wait and b.turn_ms == t0 + 1 + CONCURRENCY_POLL_MS
    # still running at b's turn: b asks again later
    again = await lim.admit(_call(tenant, "b", b.turn_ms, t0 + 1, limit=slot, lease_ms=60_000))
    assert again.wait
    await lim.settle(a.ledger, [], ledger_ttl_ms=600_000)  # a ends: its slot is free
    done = await lim.admit(_call(tenant, "b", again.turn_ms, t0 + 1, limit=slot, lease_ms=60_000))
    assert done.admitted
    # past the deadline with the slot still held, refused
    late = await lim.admit(_call(tenant, "c", t0 + 2, t0 - 15_000, limit=slot, lease_ms=60_000))
    assert not late.admitted and not late.wait
