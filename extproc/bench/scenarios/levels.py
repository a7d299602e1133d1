"""Levels (issue 36): admission with 4 levels (organisation, team, tenant, end user) against 1
level.  End to end: the main stack's processor CPU per non-streaming request of a key counted
at 4 levels (``sk-levels``) against the bench key (1 level), the two keys alternated on the
same processor, and the Redis calls of each.  The admission path alone
(:mod:`extproc.bench.levels_micro`: planning, charges, the limiter's calls against a real Redis
it starts): this process's CPU, the Redis server's CPU and the limiter calls per request,
without and with allowances."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from extproc.bench import levels_micro, system
from extproc.bench.drivers import KEY, batch, interleave, med_rounds, ok_count
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.admission import SETTLE_S, SHAPE
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack

#: The key of the bench rules counted at 4 levels (extproc.bench.system.bench_rules).
LEVELS_KEY = "sk-levels"

#: Issue 36's target: 4 levels at most 15 % more admission CPU than 1.
CPU_RATIO = 1.15


async def end_to_end(b: Bench, main: Stack) -> None:
    """Processor CPU and Redis calls per non-streaming request, 4 levels against 1, on the main
    stack's one processor (the keys alternate: each round's two batches saw the same machine)."""
    meter = system.CpuMeter(system.proc_pids(main, "extproc"))
    n, c = b.plan.fixed_requests, b.plan.fixed_concurrency
    b.log(f"levels: processor CPU per request, 4 levels vs 1: {n} at c={c} x {b.plan.rounds}")
    for key in (KEY, LEVELS_KEY):  # warm-up
        await batch(main.base_url, key, SHAPE, count=20, concurrency=c)

    async def one_round(key: str) -> dict[str, float]:
        before = system.redis_calls(main.ports.redis)
        meter.start()
        rs = await batch(main.base_url, key, SHAPE, count=n, concurrency=c)
        await asyncio.sleep(SETTLE_S)
        cpu = meter.stop()
        calls = system.limiter_round_trips(before, system.redis_calls(main.ports.redis))
        done = max(1, ok_count(rs))
        return {
            "cpu_per_req_us": cpu / done * 1e6,
            "calls_per_req": sum(calls.values()) / done,
            "errors": float(len(rs) - ok_count(rs)),
        }

    keys = {"1 level": KEY, "4 levels": LEVELS_KEY}
    rounds = await interleave(b.plan.rounds, {a: partial(one_round, k) for a, k in keys.items()})
    errors = sum(r["errors"] for rs in rounds.values() for r in rs)
    med = {arm: {k: med_rounds([r[k] for r in rs]) for k in rs[0]} for arm, rs in rounds.items()}
    b.raw.setdefault("levels", {})["end_to_end"] = {"rounds": rounds, "median": med}
    ratios = [
        f["cpu_per_req_us"] / o["cpu_per_req_us"]
        for o, f in zip(rounds["1 level"], rounds["4 levels"], strict=True)
        if o["cpu_per_req_us"] > 0
    ]
    b.table.add(
        Row(
            "15 levels",
            "processor CPU per non-streaming request, 4 levels (base = 1 level)",
            "µs",
            med["4 levels"]["cpu_per_req_us"],
            med["1 level"]["cpu_per_req_us"],
            goal=Target("ratio", "<=", CPU_RATIO),
            note=(f"ratio per round {min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "")
            + (f", {errors:.0f} failed requests" if errors else ""),
        )
    )
    b.table.add(
        Row(
            "15 levels",
            "Redis calls per non-streaming request, 4 levels (base = 1 level)",
            "calls",
            med["4 levels"]["calls_per_req"],
            med["1 level"]["calls_per_req"],
        )
    )


async def measure(b: Bench, stacks: Stacks) -> None:
    """End to end on the main stack, then the micro-benchmark's arms interleaved."""
    await end_to_end(b, stacks.shared)
    n = 300 if b.plan.rounds < 5 else 1000
    b.log(f"levels: 4 levels vs 1, {n} requests per arm x {b.plan.rounds} rounds")
    res: dict[str, Any] = await levels_micro.run(n, 16, b.plan.rounds)
    b.raw.setdefault("levels", {})["micro"] = res
    arms = res["arms"]

    def med(arm: str, fig: str) -> float:
        return float(arms[arm][fig]["median"])

    for fig, label, unit, goal in (
        ("cpu_us_per_request", "admission + settlement CPU per request", "µs", True),
        ("redis_cpu_us_per_request", "Redis server CPU per request", "µs", False),
        ("calls_per_request", "limiter calls per request (admit + settle)", "calls", False),
    ):
        b.table.add(
            Row(
                "15 levels",
                f"{label}, 4 levels, admission path alone (base = 1 level)",
                unit,
                med("4 levels", fig),
                med("1 level", fig),
                note="the processor's other per-request work is not in it" if goal else "",
            )
        )
    b.table.add(
        Row(
            "15 levels",
            "limiter calls per request with allowances, 3 levels (base = 1 level)",
            "calls",
            med("3 levels (no end users), allowances", "calls_per_request"),
            med("1 level, allowances", "calls_per_request"),
        )
    )
    b.table.add(
        Row(
            "15 levels",
            "limiter calls per request with allowances, 4 levels (base = 1 level)",
            "calls",
            med("4 levels, allowances", "calls_per_request"),
            med("1 level, allowances", "calls_per_request"),
            note="a team's set of distinct end users is never in an allowance",
        )
    )


SCENARIO = Scenario("levels", measure, on_main=True)
