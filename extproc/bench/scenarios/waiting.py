"""Waiting (issue 38): a burst of many tenants over their RPM at a window boundary, served by
waiting (a plan with ``wait``) against immediate 429s with clients that retry per the 429's
``retry-after-ms`` (the OpenAI SDK's rule) until served or out of patience.

Its own stack: two Envoys in front of two processor replicas, one Redis.  Each of
:data:`TENANTS` tenants sends :data:`BURST` requests at once, just after a window starts, over a
limit of :data:`LIMIT` per :data:`WINDOW_S` s: the window arithmetic serves :data:`LIMIT` now and
:data:`LIMIT` at the next boundary within the :data:`MAX_WAIT_S` s wait; the rest would need
the boundary after that.  Both arms give up on a request after :data:`MAX_WAIT_S` s (the
waiting plan refuses it at once; a retrying client stops when its next try would come later).
Per arm: requests served, served at the first try (what an immediate 429 without retries
serves), HTTP requests sent per request (client retries), the served requests' p50 and p99
latency, and the limiter's Redis calls per request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from extproc.bench import system
from extproc.bench.drivers import med_rounds
from extproc.bench.plan import Bench
from extproc.bench.report import Row
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack
from extproc.stats import percentile

TENANTS = 20
BURST = 12
LIMIT = 5
WINDOW_S = 10
MAX_WAIT_S = 15
BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def rules() -> dict[str, Any]:
    """:data:`TENANTS` tenants per arm: ``sk-w<i>`` waits, ``sk-r<i>`` is refused at once."""
    limits = [{"model": "*", "per": f"{WINDOW_S}s", "rpm": LIMIT}]
    tenants: dict[str, Any] = {}
    for i in range(TENANTS):
        for arm, plan in (("w", "waiting"), ("r", "refusing")):
            tenants[f"{arm}{i}"] = {
                "plan": plan,
                "keys": [{"name": f"{arm}{i}", "plaintext": f"sk-{arm}{i}"}],
            }
    return {
        "version": 1,
        "models": {
            "sim-small": {
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 4096,
            }
        },
        "plans": {
            "waiting": {"limits": limits, "wait": {"max_seconds": MAX_WAIT_S}},
            "refusing": {"limits": limits},
        },
        "tenants": tenants,
    }


async def _one(http: httpx.AsyncClient, url: str, key: str, *, retry: bool) -> dict[str, Any]:
    """One request as a client sends it: once, or again after each 429's retry-after-ms while
    its next try comes within :data:`MAX_WAIT_S` of its start."""
    start = time.monotonic()
    sent = 0
    while True:
        sent += 1
        r = await http.post(url, json=BODY, headers={"authorization": f"Bearer {key}"})
        took = time.monotonic() - start
        if r.status_code != 429 or not retry:
            return {"status": r.status_code, "s": took, "sent": sent}
        pause = int(r.headers.get("retry-after-ms", "1000")) / 1000
        if took + pause > MAX_WAIT_S:
            return {"status": 429, "s": took, "sent": sent}
        await asyncio.sleep(pause)


async def burst(stack: Stack, prefix: str, *, retry: bool) -> dict[str, float]:
    """Every tenant's :data:`BURST` requests at once, 0.3 s into a fresh window, alternating
    between the Envoys."""
    now = time.time()
    start = (now // WINDOW_S + 1) * WINDOW_S
    await asyncio.sleep(start + 0.3 - now)
    before = system.redis_calls(stack.ports.redis)
    urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in stack.envoy_ports]
    limits = httpx.Limits(max_connections=TENANTS * BURST)
    async with httpx.AsyncClient(timeout=MAX_WAIT_S + 30, limits=limits) as http:
        res = await asyncio.gather(
            *(
                _one(http, urls[(i * BURST + j) % len(urls)], f"sk-{prefix}{i}", retry=retry)
                for i in range(TENANTS)
                for j in range(BURST)
            )
        )
    calls = system.limiter_round_trips(before, system.redis_calls(stack.ports.redis))
    served = [r for r in res if r["status"] == 200]
    lat = sorted(r["s"] * 1000 for r in served)
    n = len(res)
    return {
        "served": len(served) / n,
        "first_try": sum(1 for r in served if r["sent"] == 1) / n,
        "sent_per_request": sum(r["sent"] for r in res) / n,
        "p50_ms": percentile(lat, 50) or 0.0,
        "p99_ms": percentile(lat, 99) or 0.0,
        "redis_calls_per_request": sum(calls.values()) / n,
        "other": float(sum(1 for r in res if r["status"] not in (200, 429))),
    }


async def measure(b: Bench, stacks: Stacks) -> None:
    """The two arms alternated for the plan's rounds (at most 3: each burst takes a window or
    two)."""
    stack = await asyncio.to_thread(
        system.start_stack, b.workdir / "waiting", rules(), envoys=2, extprocs=2
    )
    stacks.started.append(stack)
    rounds = min(3, max(1, b.plan.rounds // 2))
    b.log(
        f"waiting: {TENANTS} tenants x {BURST} requests at a boundary, {LIMIT} per "
        f"{WINDOW_S} s, waiting vs 429 + retry, {rounds} round(s)"
    )
    arms = {"waiting": ("w", False), "429 + retry": ("r", True)}
    got: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    for _ in range(rounds):
        for arm, (prefix, retry) in arms.items():
            got[arm].append(await burst(stack, prefix, retry=retry))
    stack.stop()
    med = {a: {k: med_rounds([r[k] for r in rs]) for k in rs[0]} for a, rs in got.items()}
    b.raw["waiting"] = {"rounds": got, "median": med}
    w, r = med["waiting"], med["429 + retry"]
    note = f"{TENANTS} tenants x {BURST} at once, {LIMIT} per {WINDOW_S} s, {MAX_WAIT_S} s patience"
    for key, label, unit in (
        ("served", "requests served (base = 429 + retry)", "share"),
        ("sent_per_request", "HTTP requests sent per request (base = 429 + retry)", "requests"),
        ("p50_ms", "p50 latency of the served (base = 429 + retry)", "ms"),
        ("p99_ms", "p99 latency of the served (base = 429 + retry)", "ms"),
        ("redis_calls_per_request", "Redis calls per request (base = 429 + retry)", "calls"),
    ):
        b.table.add(Row("38 waiting", label, unit, w[key], r[key], note=note))
    b.table.add(
        Row(
            "38 waiting",
            "requests served with immediate 429s and no retry (base = waiting)",
            "share",
            r["first_try"],
            w["served"],
            note="the retrying arm's first tries",
        )
    )


SCENARIO = Scenario("waiting", measure)
