"""Load drivers shared by the benchmark scenarios: closed-loop batches and timed runs, the
A/B interleaving of arms, and the small summaries taken over their results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import aiohttp

from extproc.bench.client import Result, Shape, connector, send
from extproc.bench.plan import Bench
from extproc.stats import median, percentile

T = TypeVar("T")
MS = 1000.0
US = 1_000_000.0

#: The API key of the scenarios that do not test a particular limit.
KEY = "sk-bench"


async def batch(
    url: str,
    key: str,
    shape: Shape,
    *,
    count: int,
    concurrency: int,
    deadline_s: float = 120.0,
    bench: Bench | None = None,
    tag: str = "r",
) -> list[Result]:
    """Send ``count`` requests with ``concurrency`` closed-loop workers (bounded in time)."""
    out: list[Result] = []
    todo = iter(range(count))
    stop_at = time.monotonic() + deadline_s
    async with aiohttp.ClientSession(connector=connector(concurrency)) as session:

        async def worker() -> None:
            for n in todo:
                if time.monotonic() > stop_at:
                    return
                rid = bench.rid(tag) if bench else ""
                out.append(
                    await send(session, url, key, shape, body=shape.body(n), client_request_id=rid)
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def timed(
    url: str, key: str, shape: Shape, *, seconds: float, concurrency: int, cap: int = 100_000
) -> tuple[list[Result], float]:
    """Closed loop for ``seconds`` (no new request after that; at most ``cap``)."""
    out: list[Result] = []
    started = time.perf_counter()
    stop_at = started + seconds
    sent = 0
    async with aiohttp.ClientSession(connector=connector(concurrency)) as session:

        async def worker() -> None:
            nonlocal sent
            while time.perf_counter() < stop_at and sent < cap:
                sent += 1
                out.append(await send(session, url, key, shape, body=shape.body(sent)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, time.perf_counter() - started


async def interleave(
    rounds: int, arms: Mapping[str, Callable[[], Awaitable[T]]]
) -> dict[str, list[T]]:
    """Run every arm once per round, in the same order (A B A B ...)."""
    out: dict[str, list[T]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            out[name].append(await fn())
    return out


def ok_count(results: list[Result]) -> int:
    """Requests answered 200 without a client error."""
    return sum(1 for r in results if r.status == 200 and not r.error)


def pct_ms(results: list[Result], q: float, attr: str = "latency") -> float | None:
    """Percentile ``q`` of an attribute of the successful results, in ms."""
    vals = [getattr(r, attr) for r in results if r.status == 200 and getattr(r, attr) is not None]
    p = percentile(vals, q)
    return None if p is None else p * MS


def med_rounds(per_round: list[float | None]) -> float | None:
    """Median of the per-round figures that exist."""
    return median(x for x in per_round if x is not None)
