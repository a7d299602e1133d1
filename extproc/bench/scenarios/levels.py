"""Levels (issue 36): admission with 4 levels (organisation, team, tenant, end user) against 1
level, the admission path alone (:mod:`extproc.bench.levels_micro`: planning, charges, the
limiter's calls against a real Redis it starts): this process's CPU, the Redis server's CPU
and the limiter calls per request, without and with allowances."""

from __future__ import annotations

from typing import Any

from extproc.bench import levels_micro
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks

#: Issue 36's target: 4 levels at most 15 % more admission CPU than 1.
CPU_RATIO = 1.15


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run the micro-benchmark's arms interleaved; a row per figure."""
    _ = stacks
    n = 300 if b.plan.rounds < 5 else 1000
    b.log(f"levels: 4 levels vs 1, {n} requests per arm x {b.plan.rounds} rounds")
    res: dict[str, Any] = await levels_micro.run(n, 16, b.plan.rounds)
    b.raw["levels"] = res
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
                f"{label}, 4 levels (base = 1 level)",
                unit,
                med("4 levels", fig),
                med("1 level", fig),
                goal=Target("ratio", "<=", CPU_RATIO) if goal else None,
                note="the admission path alone: the processor's other per-request work is not in it"
                if goal
                else "",
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


SCENARIO = Scenario("levels", measure, on_main=False)
