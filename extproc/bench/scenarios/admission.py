"""Section 1, admission overhead: non-streaming latency through the filtered listener versus
the same Envoy's listener without the filter, at concurrency 1 and 16."""

from __future__ import annotations

from functools import partial
from typing import Any

from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch, interleave, med_rounds, ok_count, pct_ms
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack


async def admission(b: Bench, main: Stack, baseline_url: str) -> None:
    """Non-streaming, 1k-token prompt, filtered listener vs the same Envoy's baseline listener."""
    shape = Shape(prompt_tokens=1000, max_tokens=8)
    raw: dict[str, Any] = {}
    for c, n in ((1, b.plan.admit_c1), (16, b.plan.admit_c16)):
        b.log(f"admission: concurrency {c}, {n} requests per arm x {b.plan.rounds} rounds")
        res = await interleave(
            b.plan.rounds,
            {
                "baseline": partial(batch, baseline_url, KEY, shape, count=n, concurrency=c),
                "gateway": partial(batch, main.base_url, KEY, shape, count=n, concurrency=c),
            },
        )
        summary: dict[str, Any] = {}
        for q in (50, 99):
            base = med_rounds([pct_ms(r, q) for r in res["baseline"]])
            gw = med_rounds([pct_ms(r, q) for r in res["gateway"]])
            summary[f"p{q}"] = {"baseline": base, "gateway": gw}
            goal = Target("delta", "<=", 2, "ms") if (q, c) == (50, 1) else None
            b.table.add(Row("1 admission", f"latency p{q}, c={c}", "ms", gw, base, goal=goal))
        summary["errors"] = {arm: sum(len(r) - ok_count(r) for r in rs) for arm, rs in res.items()}
        raw[f"c{c}"] = summary
    b.raw["admission"] = raw


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack."""
    await admission(b, stacks.shared, stacks.baseline_url)


SCENARIO = Scenario("admission", measure, on_main=True)
