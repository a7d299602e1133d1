"""The limiter contract: every backend (the in-memory limiter, Redis, a three-node Redis
Cluster) admits atomically, charges streams idempotently and settles once, exactly alike; and
its RLS counter (:class:`extproc.limiter.base.RlsCounter`) checks and counts a request's
counters the same way.

The scripts' other contracts (budgets, shadow limits, concurrency slots, sliding windows,
cancels, reclaim) are in ``test_budget_scripts.py`` and ``test_reservation_reclaim.py``, on
the same ``backend`` fixture."""

from __future__ import annotations

import time
import uuid

import pytest

from extproc.core.keys import EXPIRY_SLACK_MS, ledger_key, windowed
from extproc.core.rules import Adjustment, BucketCharge, Limit
from extproc.limiter.base import (
    RLS_ENFORCED,
    RLS_QUOTA,
    RLS_SHADOW,
    AdmitCall,
    ChargeCall,
    RlsCounter,
    SettleCall,
)
from extproc.limiter.memory import MemoryLimiter
from extproc.limiter.redis import RedisLimiter
from extproc.limiter.rls_counter import rls_counter
from extproc.rls.load import compile_domains
from extproc.rls.match import plan
from extproc.rls.parse import parse_text
from extproc.rls.request import Descriptor
from tests.limiters import Backend

pytestmark = pytest.mark.integration

TTL = 60_000


def far() -> int:
    """An expiry two minutes from now (unix ms)."""
    return int(time.time() * 1000) + 120_000


def uniq(prefix: str) -> str:
    """A fresh hash-tagged key prefix."""
    return f"t:{{{prefix}-{uuid.uuid4().hex[:8]}}}"


def buckets(tag: str, rpm_limit: int, tpm_limit: int, amount: int) -> list[BucketCharge]:
    """An RPM and a TPM bucket of one request."""
    return [
        BucketCharge(f"{tag}:rpm", "rpm", 1, rpm_limit, far()),
        BucketCharge(f"{tag}:tpm", "tpm", amount, tpm_limit, far()),
    ]


async def test_admission_charges_every_bucket(backend: Backend) -> None:
    """An admitted request adds 1 to RPM and its cost to TPM, with an expiry on each key."""
    lim = backend.limiter
    tag = uniq("a")
    res = await lim.admit(
        AdmitCall(
            f"{tag}:req:1",
            buckets(tag, 5, 100, 40),
            tpm_charged=40,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    assert res.admitted and not res.duplicate
    assert res.values == (1, 40)
    p = backend.probe
    assert await p.counter(f"{tag}:tpm") == 40
    assert 0 < await p.ttl_ms(f"{tag}:tpm") <= 120_000
    assert await p.ledger_state(f"{tag}:req:1") == "admitted"


async def test_admission_is_all_or_nothing(backend: Backend) -> None:
    """When one bucket would overflow, no bucket is charged."""
    lim = backend.limiter
    tag = uniq("b")
    await lim.admit(
        AdmitCall(
            f"{tag}:req:1",
            buckets(tag, 5, 100, 90),
            tpm_charged=90,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    res = await lim.admit(
        AdmitCall(
            f"{tag}:req:2",
            buckets(tag, 5, 100, 20),
            tpm_charged=20,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    assert not res.admitted
    assert res.values == (1, 90)
    p = backend.probe
    assert await p.counter(f"{tag}:rpm") == 1
    assert await p.counter(f"{tag}:tpm") == 90
    assert not await p.exists(f"{tag}:req:2")


async def test_refused_requests_count_toward_rpm_when_configured(backend: Backend) -> None:
    """count_refused adds the refused request to RPM buckets only."""
    lim = backend.limiter
    tag = uniq("c")
    await lim.admit(
        AdmitCall(
            f"{tag}:req:1",
            buckets(tag, 5, 100, 100),
            tpm_charged=100,
            count_refused=True,
            ledger_ttl_ms=TTL,
        )
    )
    res = await lim.admit(
        AdmitCall(
            f"{tag}:req:2",
            buckets(tag, 5, 100, 1),
            tpm_charged=1,
            count_refused=True,
            ledger_ttl_ms=TTL,
        )
    )
    assert not res.admitted
    assert res.values == (2, 100)


async def test_replayed_request_id_is_not_charged_twice(backend: Backend) -> None:
    """A second admission with the same ledger key is reported as duplicate and costs nothing."""
    lim = backend.limiter
    tag = uniq("d")
    await lim.admit(
        AdmitCall(
            f"{tag}:req:1",
            buckets(tag, 5, 100, 30),
            tpm_charged=30,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    res = await lim.admit(
        AdmitCall(
            f"{tag}:req:1",
            buckets(tag, 5, 100, 30),
            tpm_charged=30,
            count_refused=False,
            ledger_ttl_ms=TTL,
        )
    )
    assert res.duplicate and not res.admitted
    assert await backend.probe.counter(f"{tag}:tpm") == 30


async def test_lazy_charge_reports_exhaustion_and_is_idempotent(backend: Backend) -> None:
    """Lazy charges always apply; a replayed sequence number applies once."""
    lim = backend.limiter
    tag = uniq("e")
    led = f"{tag}:req:1"
    await lim.admit(
        AdmitCall(
            led, buckets(tag, 5, 100, 50), tpm_charged=50, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 40, 100, far())]
    r1 = await lim.charge(led, 1, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert r1.granted == 40 and not r1.exhausted and r1.values == (90,)
    again = await lim.charge(led, 1, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert again.granted == 40 and again.values == (90,)
    r2 = await lim.charge(led, 2, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert r2.granted == 40 and r2.exhausted and r2.values == (130,)
    stale = await lim.charge(led, 1, tpm, 40, strict=False, ledger_ttl_ms=TTL)
    assert stale.granted == 0
    assert await backend.probe.counter(f"{tag}:tpm") == 130


async def test_strict_lease_grants_only_the_room_left(backend: Backend) -> None:
    """A strict lease is cut to what every bucket still has, then nothing."""
    lim = backend.limiter
    tag = uniq("f")
    led = f"{tag}:req:1"
    await lim.admit(
        AdmitCall(
            led, buckets(tag, 5, 100, 80), tpm_charged=80, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 64, 100, far())]
    r1 = await lim.charge(led, 1, tpm, 64, strict=True, ledger_ttl_ms=TTL)
    assert r1.granted == 20 and r1.exhausted and r1.values == (100,)
    r2 = await lim.charge(led, 2, tpm, 64, strict=True, ledger_ttl_ms=TTL)
    assert r2.granted == 0 and r2.exhausted
    assert await backend.probe.counter(f"{tag}:tpm") == 100


async def test_settlement_applies_once(backend: Backend) -> None:
    """Settlement charges and refunds once; later settles and charges change nothing."""
    lim = backend.limiter
    tag = uniq("g")
    led = f"{tag}:req:1"
    await lim.admit(
        AdmitCall(
            led, buckets(tag, 5, 1000, 500), tpm_charged=500, count_refused=False, ledger_ttl_ms=TTL
        )
    )
    adj = [Adjustment(f"{tag}:tpm", -380, far())]
    assert await lim.settle(led, adj, ledger_ttl_ms=TTL) is True
    assert await lim.settle(led, adj, ledger_ttl_ms=TTL) is False
    late = await lim.charge(
        led,
        1,
        [BucketCharge(f"{tag}:tpm", "tpm", 50, 1000, far())],
        50,
        strict=False,
        ledger_ttl_ms=TTL,
    )
    assert late.granted == 0
    p = backend.probe
    assert await p.counter(f"{tag}:tpm") == 120
    assert await p.ledger_state(led) == "settled"


async def test_refund_never_goes_below_zero_nor_revives_expired_windows(backend: Backend) -> None:
    """A refund larger than the counter stops at zero; a refund to a vanished window is dropped."""
    lim = backend.limiter
    tag = uniq("h")
    p = backend.probe
    await p.seed_counter(f"{tag}:tpm", 10, ttl_ms=60_000)
    ok = await lim.settle(
        f"{tag}:req:1",
        [
            Adjustment(f"{tag}:tpm", -50, far()),
            Adjustment(f"{tag}:gone", -50, far()),
            Adjustment(f"{tag}:new", 7, far()),
        ],
        ledger_ttl_ms=TTL,
    )
    assert ok
    assert await p.counter(f"{tag}:tpm") == 0
    assert 0 < await p.ttl_ms(f"{tag}:tpm") <= 60_000
    assert not await p.exists(f"{tag}:gone")
    assert await p.counter(f"{tag}:new") == 7


async def test_read_returns_zero_for_missing_keys(backend: Backend) -> None:
    """Counters that do not exist read as 0."""
    lim = backend.limiter
    tag = uniq("i")
    await backend.probe.seed_counter(f"{tag}:a", 5)
    assert await lim.read([f"{tag}:a", f"{tag}:b"]) == [5, 0]


async def test_admit_charge_settle_with_a_tenants_windowed_keys(backend: Backend) -> None:
    """Admission, a stream charge and settlement on the keys the gateway builds for a tenant
    (on a Cluster: no CROSSSLOT error, every key shares the tenant's slot)."""
    lim = backend.limiter
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    limits = (
        Limit("rpm", 10, 60, "*", "tenant"),
        Limit("tpm", 1000, 60, "*", "tenant"),
        Limit("tpm", 500, 3600, "m", "key"),
    )
    now = int(time.time() * 1000)
    windows = windowed("aiq", tenant, "k1", limits, now)
    led = ledger_key("aiq", tenant, "req-1")
    charges = [
        BucketCharge(b.key, "rpm", 1, b.limit.limit, b.expire_at_ms)
        if b.metric == "rpm"
        else BucketCharge(b.key, "tpm", 100, b.limit.limit, b.expire_at_ms)
        for b in windows
    ]
    res = await lim.admit(
        AdmitCall(led, charges, tpm_charged=100, count_refused=False, ledger_ttl_ms=TTL)
    )
    assert res.admitted and res.values == (1, 100, 100)
    tpm = [c for c in charges if c.kind == "tpm"]
    ch = await lim.charge(led, 1, tpm, 450, strict=True, ledger_ttl_ms=TTL)
    assert ch.granted == 400 and ch.exhausted  # the 500/hour key bucket binds
    assert await lim.settle(
        led, [Adjustment(c.key, -300, c.expire_at_ms) for c in tpm], ledger_ttl_ms=TTL
    )
    assert await lim.read([b.key for b in windows]) == [1, 200, 200]


async def test_batches_charge_and_settle_as_single_calls_do(backend: Backend) -> None:
    """charge_many and settle_many judge each item as charge and settle would: in order,
    a replayed sequence number and a repeated ledger are no-ops."""
    lim = backend.limiter
    assert isinstance(lim, MemoryLimiter | RedisLimiter)  # both batch
    tag = uniq("m")
    leds = [f"{tag}:req:{i}" for i in range(3)]
    for led in leds:
        await lim.admit(
            AdmitCall(
                led,
                buckets(tag, 10, 1000, 10),
                tpm_charged=10,
                count_refused=False,
                ledger_ttl_ms=TTL,
            )
        )
    tpm = [BucketCharge(f"{tag}:tpm", "tpm", 0, 1000, far())]
    calls = [ChargeCall(led, 1, tpm, 100, False, TTL) for led in leds]
    calls.append(ChargeCall(leds[0], 1, tpm, 100, False, TTL))  # replayed: nothing more
    got = await lim.charge_many(calls)
    assert [g.granted if g else None for g in got] == [100, 100, 100, 100]
    assert [g.values if g else None for g in got] == [(130,), (230,), (330,), (330,)]
    refund = [Adjustment(f"{tag}:tpm", -60, far())]
    again = SettleCall(leds[0], refund, TTL)  # the same ledger later in the batch: a no-op
    settled = await lim.settle_many(
        [SettleCall(leds[0], refund, TTL), SettleCall(leds[1], refund, TTL), again]
    )
    assert settled == [True, True, False]
    assert await backend.probe.counter(f"{tag}:tpm") == 330 - 120
    assert await backend.probe.ledger_state(leds[2]) == "admitted"


# -- the RLS API's counter (envoyproxy/ratelimit's protocol) --------------------------------

HOUR_RULE = (
    "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n"
    "      - key: metric\n        rate_limit: {unit: hour, requests_per_unit: 5}\n"
    "      - key: shadow\n        shadow_mode: true\n"
    "        rate_limit: {unit: hour, requests_per_unit: 2}\n"
)


def rls_of(backend: Backend) -> RlsCounter:
    """The backend's RLS counter (Redis's composed with the limiter, the in-memory one's own)."""
    counter = rls_counter(backend.limiter)
    assert counter is not None
    return counter


async def test_rls_check_is_all_or_nothing(backend: Backend) -> None:
    """One enforced counter over refuses the request and nothing is added anywhere; the
    values before the request come back in order; a new counter gets its window's expiry;
    one script call per request."""
    rls = rls_of(backend)
    tag, exp = uniq("rls-a"), far()
    a, b = f"{tag}:a", f"{tag}:b"
    calls = backend.limiter.round_trips  # type: ignore[attr-defined]
    assert await rls.rls_check([(a, 3, 5, exp, RLS_ENFORCED), (b, 4, 5, exp, RLS_ENFORCED)]) == (
        True,
        [0, 0],
    )
    assert backend.limiter.round_trips - calls == 1  # type: ignore[attr-defined]
    ok, before = await rls.rls_check([(a, 1, 5, exp, RLS_ENFORCED), (b, 2, 5, exp, RLS_ENFORCED)])
    assert (ok, before) == (False, [3, 4])
    p = backend.probe
    assert (await p.counter(a), await p.counter(b)) == (3, 4)
    assert 0 < await p.ttl_ms(a) <= 120_000


async def test_rls_limit_is_inclusive_and_hits_add_up(backend: Backend) -> None:
    """A request whose hits take the counter exactly to its limit passes; one hit past it is
    refused; the hits of each passed request add up (hits_addend)."""
    rls = rls_of(backend)
    k, exp = f"{uniq('rls-b')}:c", far()
    assert await rls.rls_check([(k, 3, 5, exp, RLS_ENFORCED)]) == (True, [0])
    assert await rls.rls_check([(k, 3, 5, exp, RLS_ENFORCED)]) == (False, [3])
    assert await rls.rls_check([(k, 2, 5, exp, RLS_ENFORCED)]) == (True, [3])
    assert await rls.rls_check([(k, 1, 5, exp, RLS_ENFORCED)]) == (False, [5])
    assert await backend.probe.counter(k) == 5


async def test_rls_repeated_key_sees_the_earlier_hits(backend: Backend) -> None:
    """The same counter twice in one request: the second sees the first's hits."""
    rls = rls_of(backend)
    a, exp = f"{uniq('rls-c')}:c", far()
    ok, before = await rls.rls_check([(a, 2, 3, exp, RLS_ENFORCED), (a, 2, 3, exp, RLS_ENFORCED)])
    assert (ok, before) == (False, [0, 2])
    ok, before = await rls.rls_check([(a, 1, 3, exp, RLS_ENFORCED), (a, 2, 3, exp, RLS_ENFORCED)])
    assert (ok, before) == (True, [0, 1])
    assert await backend.probe.counter(a) == 3


async def test_rls_shadow_quota_and_check_only(backend: Backend) -> None:
    """Shadow counters count and never refuse, nor make an enforced one's request refused;
    quota counters refuse only all together (an enforced one over refuses regardless); 0
    hits adds nothing and creates no key."""
    rls = rls_of(backend)
    tag, exp = uniq("rls-d"), far()
    s, e, q1, q2, c = (f"{tag}:{n}" for n in ("s", "e", "q1", "q2", "c"))
    assert await rls.rls_check([(s, 10, 1, exp, RLS_SHADOW), (e, 1, 5, exp, RLS_ENFORCED)]) == (
        True,
        [0, 0],
    )
    assert (await rls.rls_check([(q1, 2, 1, exp, RLS_QUOTA), (q2, 1, 1, exp, RLS_QUOTA)]))[0]
    assert not (await rls.rls_check([(q1, 1, 1, exp, RLS_QUOTA), (q2, 1, 1, exp, RLS_QUOTA)]))[0]
    assert not (await rls.rls_check([(q2, 0, 1, exp, RLS_QUOTA), (e, 5, 5, exp, RLS_ENFORCED)]))[0]
    assert await rls.rls_check([(c, 0, 1, exp, RLS_ENFORCED)]) == (True, [0])
    p = backend.probe
    assert (await p.counter(s), await p.counter(e)) == (10, 1)
    assert (await p.counter(q1), await p.counter(q2)) == (2, 1)
    assert not await p.exists(c)


async def test_rls_windows_are_counters_of_their_own(backend: Backend) -> None:
    """Planned by the RLS matcher: the next window's counter starts at 0 while this one is
    full; each expires at its window's end (plus the slack); a shadow rule over its limit is
    counted and answered OK."""
    cfg = compile_domains([parse_text(HOUR_RULE, "d.yaml")])
    tenant = f"t{uuid.uuid4().hex[:8]}"
    rls = rls_of(backend)
    now = int(time.time() * 1000)
    next_hour = (now // 3_600_000 + 1) * 3_600_000
    metric = Descriptor((("tenant", tenant), ("metric", "rpm")))
    shadow = Descriptor((("tenant", tenant), ("shadow", "x")))

    def counters(at_ms: int, hits: int) -> list[tuple[str, int, int, int, int]]:
        p = plan(cfg, "d", [metric, shadow], hits, at_ms)
        return [(c.key, c.hits, c.limit, c.expire_at_ms, c.mode) for c in p.counted]

    this, following = counters(now, 5), counters(next_hour, 5)
    assert this[0][0] != following[0][0]
    assert await rls.rls_check(this) == (True, [0, 0])  # the shadow rule is already over
    ok, before = await rls.rls_check(counters(now, 1))
    assert (ok, before) == (False, [5, 5])
    assert await rls.rls_check(following) == (True, [0, 0])
    p = backend.probe
    assert await p.counter(this[0][0]) == 5 and await p.counter(this[1][0]) == 5
    ttl = await p.ttl_ms(this[0][0])
    assert 0 < ttl <= next_hour + EXPIRY_SLACK_MS - now
    assert ttl > (await p.ttl_ms(following[0][0])) - 3_600_000 - 1000


async def test_input_shortcut_stops_are_kept_once_per_config_version(backend: Backend) -> None:
    """input_stop.lua: the first finder's entry is kept, a second stop (another replica, a
    retried call) changes nothing, every replica reads the model back; another config
    version's hash is a separate one; on Redis the hash expires (its TTL is set)."""
    from extproc.core.keys import input_stops_key
    from extproc.limiter.base import InputStopStore

    store: InputStopStore = backend.limiter  # type: ignore[assignment]
    prefix = f"c{uuid.uuid4().hex[:8]}"
    key, other = input_stops_key(prefix, "v1"), input_stops_key(prefix, "v2")
    assert await store.input_stops(key) == []
    assert await store.stop_input_shortcut(key, "m", '{"replica":"a"}', 60_000)
    assert not await store.stop_input_shortcut(key, "m", '{"replica":"b"}', 60_000)
    assert await store.stop_input_shortcut(key, "n", '{"replica":"b"}', 60_000)
    assert sorted(await store.input_stops(key)) == ["m", "n"]
    assert await store.input_stops(other) == []
    if backend.name != "memory":
        assert 0 < await backend.probe.ttl_ms(key) <= 60_000
