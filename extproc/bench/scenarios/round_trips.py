"""Section 3, Redis round trips: limiter calls (INFO commandstats) per streamed and per
non-streaming request."""

from __future__ import annotations

import asyncio
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch, ok_count
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack

#: Issue 17's targets: round trips per non-streaming request, and per stream beyond output / N.
NON_STREAM_CALLS = 1.2
STREAM_EXTRA_CALLS = 1.2


def stream_target(output_tokens: int, every: int) -> float:
    """Round trips a stream of ``output_tokens`` may take with a charge every ``every`` tokens
    (output / N + 1.2), to two decimals (500 tokens at N = 64: 9.01)."""
    return round(output_tokens / every + STREAM_EXTRA_CALLS, 2)


async def round_trips(b: Bench, main: Stack) -> None:
    """Limiter calls (INFO commandstats) per streamed and per non-streaming request."""
    raw: dict[str, Any] = {}
    every = b.plan.every
    streamed = Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1)
    cases = (
        (
            f"streamed, {streamed.max_tokens} tokens",
            streamed,
            20,
            stream_target(streamed.max_tokens, every),
        ),
        ("non-streaming", Shape(prompt_tokens=1000, max_tokens=8), 50, NON_STREAM_CALLS),
    )
    for name, shape, n, bound in cases:
        before = system.redis_calls(main.ports.redis)
        rs = await batch(main.base_url, KEY, shape, count=n, concurrency=4)
        await asyncio.sleep(0.3)
        after = system.redis_calls(main.ports.redis)
        calls = system.limiter_round_trips(before, after)
        per = sum(calls.values()) / max(1, ok_count(rs))
        raw[name] = {
            "requests": len(rs),
            "ok": ok_count(rs),
            "calls": calls,
            "per_request": per,
            "target": bound,
        }
        b.table.add(
            Row(
                "3 redis",
                f"round trips per request, {name}",
                "calls",
                per,
                goal=Target("value", "<=", bound, "calls"),
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
