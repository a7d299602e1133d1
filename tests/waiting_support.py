"""The waiting rule, checked by simulation: shared by the Hypothesis test on the in-memory
limiter (tests/unit/test_waiting.py) and the seeded one on the real admit.lua
(tests/integration/test_waiting_scripts.py).

Requests of several tenants arrive at given times, each over an RPM limit per fixed window
with a maximum wait; each is driven as the processor drives it: admitted, refused, or told to
wait until its turn and asked again then (same ledger).  The outcome must be the *ideal* one,
computed apart per tenant by the plain window arithmetic: requests in arrival order, each
served at the earliest time from its arrival (and not before the request before it) at which
its window has room, refused when that is after its deadline.  Equality means: never beyond a
limit, never a refusal that could have been served within its wait, served in arrival order,
and one tenant's waiters never move another tenant's outcome."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.core.admission_plan import admission_charges, buckets_for, compute_cost
from extproc.core.keys import ledger_key, tenant_tag
from extproc.core.rules import Charging, Limit
from extproc.core.waiting import QueueCall, bucket_kinds, queue_keys
from extproc.limiter.base import AdmitCall, Limiter

PREFIX = "aiqw"


@dataclass(frozen=True)
class Outcome:
    """A request's end: admitted at ``at_ms`` (None: refused) after ``calls`` calls; refused,
    the ``retry_ms`` it was told (its turn less the time of the refusal; 0 none)."""

    at_ms: int | None
    calls: int
    retry_ms: int = 0


def ideal(
    arrivals: Sequence[int],
    *,
    limit: int,
    window_ms: int,
    max_wait_ms: int,
    sizes: Sequence[int] = (),
) -> list[int | None]:
    """Each request's admission time by the window arithmetic (None: refused at once): in
    arrival order, from its arrival and not before the request admitted before it, the first
    window with room for it (``sizes``: each one's units, else 1)."""
    used: dict[int, int] = {}
    last = 0
    out: list[int | None] = []
    for i, a in enumerate(arrivals):
        n = sizes[i] if sizes else 1
        t = max(a, last)
        while n <= limit and used.get(t // window_ms, 0) + n > limit:
            t = (t // window_ms + 1) * window_ms
        if n > limit or t > a + max_wait_ms:
            out.append(None)
            continue
        used[t // window_ms] = used.get(t // window_ms, 0) + n
        last = t
        out.append(t)
    return out


async def simulate(
    limiter: Limiter,
    requests: Sequence[tuple[str, int]],
    *,
    limit: int,
    window_s: int,
    max_wait_ms: int,
    run: str,
    tokens: Sequence[int] = (),
    sliding: bool = False,
) -> list[Outcome]:
    """Drive each (tenant, arrival ms) through admission and its waits, in time order; with
    ``tokens`` (one per request), over a TPM limit instead of an RPM one."""
    lim = Limit("tpm" if tokens else "rpm", limit, window_s, "*", "tenant", sliding=sliding)
    events: list[tuple[int, int, int]] = []  # (time, seq, request)
    for i, (_, at) in enumerate(requests):
        heapq.heappush(events, (at, i, i))
    seq = len(requests)
    calls = [0] * len(requests)
    out: dict[int, Outcome] = {}
    while events:
        now, _, i = heapq.heappop(events)
        tenant, arrival = requests[i]
        bs = buckets_for(
            prefix=PREFIX, tenant=tenant, key_name="k", model="*", limits=(lim,), now_ms=now
        )
        queue = QueueCall(
            queue_keys(tenant_tag(PREFIX, tenant), tenant),
            0,
            arrival + max_wait_ms,
            bucket_kinds(bs),
        )
        calls[i] += 1
        n = tokens[i] if tokens else 1
        cost = compute_cost(
            input_tokens=n, per_choice_max=0, n=1, stream=False, charging=Charging()
        )
        res = await limiter.admit(
            AdmitCall(
                ledger_key(PREFIX, tenant, f"{run}.{i}"),
                admission_charges(bs, cost),
                tpm_charged=n,
                count_refused=False,
                ledger_ttl_ms=600_000,
                now_ms=now,
                queue=queue,
            )
        )
        if res.wait:
            assert res.turn_ms >= now, (i, now, res)
            seq += 1
            heapq.heappush(events, (res.turn_ms, seq, i))
        elif res.admitted:
            out[i] = Outcome(now, calls[i])
        else:
            out[i] = Outcome(None, calls[i], max(0, res.turn_ms - now))
    return [out[i] for i in range(len(requests))]


def ideal_sliding(
    arrivals: Sequence[int],
    *,
    limit: int,
    window_ms: int,
    max_wait_ms: int,
    sizes: Sequence[int] = (),
) -> list[int | None]:
    """:func:`ideal` on a sliding window: the first millisecond from its arrival (and not
    before the request admitted before it) at which the window's count, plus the previous
    window's weighted as the limiter weighs it, plus the request, is within the limit (found
    by bisection: within a window the previous one's share only falls)."""
    admitted: list[tuple[int, int]] = []
    last = 0
    out: list[int | None] = []

    def value(x: int, start: int) -> int:
        cur = sum(n for t, n in admitted if start <= t < start + window_ms)
        prev = sum(n for t, n in admitted if start - window_ms <= t < start)
        weight = (start + window_ms - x) * 1_000_000 // window_ms
        return cur + prev * weight // 1_000_000

    for i, a in enumerate(arrivals):
        n = sizes[i] if sizes else 1
        t, found = max(a, last), None
        while n <= limit and t <= a + max_wait_ms and found is None:
            start = t - t % window_ms
            end = start + window_ms
            if value(end - 1, start) + n <= limit:
                lo, hi = t, end - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    if value(mid, start) + n <= limit:
                        hi = mid
                    else:
                        lo = mid + 1
                found = lo
            t = end
        if found is None or found > a + max_wait_ms:
            out.append(None)
            continue
        admitted.append((found, n))
        last = found
        out.append(found)
    return out


def check(
    requests: Sequence[tuple[str, int]],
    got: Sequence[Outcome],
    *,
    limit: int,
    window_s: int,
    max_wait_ms: int,
    tokens: Sequence[int] = (),
    sliding: bool = False,
) -> None:
    """The simulated outcomes equal the ideal ones, tenant by tenant; a refused request was
    refused on its first call (never after waiting in vain) with the retry-after of the turn
    it would have needed (none for one alone over the limit)."""
    tenants = sorted({t for t, _ in requests})
    for tenant in tenants:
        idx = [i for i, (t, _) in enumerate(requests) if t == tenant]
        # arrival order (the order of tickets; ties in the order they were given)
        idx.sort(key=lambda i: (requests[i][1], i))
        want = (ideal_sliding if sliding else ideal)(
            [requests[i][1] for i in idx],
            limit=limit,
            window_ms=window_s * 1000,
            max_wait_ms=max_wait_ms,
            sizes=[tokens[i] for i in idx] if tokens else (),
        )
        for i, w in zip(idx, want, strict=True):
            o = got[i]
            assert o.at_ms == w, (tenant, i, requests[i], o, w)
            if w is None:
                assert o.calls == 1, (tenant, i, o)
                alone_over = bool(tokens) and tokens[i] > limit
                assert alone_over or o.retry_ms > max_wait_ms, (tenant, i, o)


def check_tokens(
    requests: Sequence[tuple[str, int]],
    tokens: Sequence[int],
    got: Sequence[Outcome],
    *,
    limit: int,
    window_s: int,
    max_wait_ms: int,
) -> None:
    """Over a TPM limit, requests of different sizes: the ideal schedule packs them in order
    (:func:`ideal`), and no window of a tenant holds more than the limit."""
    check(requests, got, limit=limit, window_s=window_s, max_wait_ms=max_wait_ms, tokens=tokens)
    used: dict[tuple[str, int], int] = {}
    for (tenant, _), n, o in zip(requests, tokens, got, strict=True):
        if o.at_ms is not None:
            w = (tenant, o.at_ms // (window_s * 1000))
            used[w] = used.get(w, 0) + n
    assert all(v <= limit for v in used.values()), used
