"""Section 3, Redis round trips: limiter calls (INFO commandstats) per streamed and per
non-streaming request."""

from __future__ import annotations

import asyncio
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch, ok_count
from extproc.bench.plan import Bench
from extproc.bench.report import Row
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack


async def round_trips(b: Bench, main: Stack) -> None:
    """Limiter calls (INFO commandstats) per streamed and per non-streaming request."""
    raw: dict[str, Any] = {}
    every = b.plan.every
    cases = (
        (
            "streamed, 500 tokens",
            Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1),
            20,
            2 + -(-500 // every) - 1,
        ),
        ("non-streaming", Shape(prompt_tokens=1000, max_tokens=8), 50, 2),
    )
    for name, shape, n, _expected in cases:
        before = system.redis_calls(main.ports.redis)
        rs = await batch(main.base_url, KEY, shape, count=n, concurrency=4)
        await asyncio.sleep(0.3)
        after = system.redis_calls(main.ports.redis)
        calls = system.limiter_round_trips(before, after)
        per = sum(calls.values()) / max(1, ok_count(rs))
        raw[name] = {"requests": len(rs), "ok": ok_count(rs), "calls": calls, "per_request": per}
        b.table.add(
            Row(
                "3 redis",
                f"round trips per request, {name}",
                "calls",
                per,
                note=", ".join(
                    f"{k} {v / max(1, ok_count(rs)):.2f}" for k, v in sorted(calls.items())
                ),
            )
        )
    raw["charge_every_tokens"] = every
    b.raw["redis"] = raw


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack."""
    await round_trips(b, stacks.shared)


SCENARIO = Scenario("redis", measure, on_main=True)
