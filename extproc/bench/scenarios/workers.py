"""Section 7, workers and event loops: streamed chunks/s and non-streaming req/s at a fixed
concurrency through one Envoy each in front of ``serve --workers 1``, ``--workers 2`` and
``--workers 1`` on the asyncio loop."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from functools import partial

from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch, interleave, med_rounds, ok_count, timed
from extproc.bench.plan import Bench
from extproc.bench.report import Row
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack


async def workers(b: Bench, variants: dict[str, Stack]) -> None:
    """Streamed chunks/s and non-streaming req/s at fixed concurrency per processor variant."""
    c, secs = b.plan.worker_concurrency, b.plan.worker_seconds
    stream = Shape(prompt_tokens=100, max_tokens=200, stream=True, itl_ms=1)
    unary = Shape(prompt_tokens=1000, max_tokens=8)
    b.log(f"workers: {list(variants)} at c={c}, {secs}s per arm x {b.plan.worker_rounds}")

    async def chunks(url: str) -> float:
        rs, el = await timed(url, KEY, stream, seconds=secs, concurrency=c)
        return sum(r.tokens for r in rs if r.status == 200) / el

    async def reqs(url: str) -> float:
        rs, el = await timed(url, KEY, unary, seconds=secs, concurrency=c)
        return ok_count(rs) / el

    arms: dict[str, Callable[[], Awaitable[float]]] = {}
    first = next(iter(variants.values()))
    if first.baseline_port:
        nofilter = f"http://127.0.0.1:{first.baseline_port}/v1"
        arms["no filter chunks/s"] = partial(chunks, nofilter)
        arms["no filter req/s"] = partial(reqs, nofilter)
    for name, s in variants.items():
        arms[f"{name} chunks/s"] = partial(chunks, s.base_url)
        arms[f"{name} req/s"] = partial(reqs, s.base_url)
    res = await interleave(b.plan.worker_rounds, arms)
    med = {k: med_rounds(list(v)) for k, v in res.items()}
    b.raw["workers"] = {"rounds": res, "median": med, "concurrency": c}
    base = next(iter(variants))
    for unit in ("chunks/s", "req/s"):
        if f"no filter {unit}" in med:
            b.table.add(
                Row(
                    "7 workers",
                    f"{unit}: {base} (base = same Envoy, no filter)",
                    unit,
                    med[f"{base} {unit}"],
                    med[f"no filter {unit}"],
                )
            )
        for name in list(variants)[1:]:
            b.table.add(
                Row(
                    "7 workers",
                    f"{unit}: {name} (base = {base})",
                    unit,
                    med[f"{name} {unit}"],
                    med[f"{base} {unit}"],
                )
            )


async def measure(b: Bench, stacks: Stacks) -> None:
    """Start one stack per processor variant, warm them, measure (the stacks are stopped at the
    end of the run)."""
    b.log("starting the worker stacks")
    serve = (sys.executable, "-m", "extproc", "serve")
    variants = {
        "1 worker uvloop": await stacks.start("w1", extproc_argv=serve, baseline=True),
        "2 workers uvloop": await stacks.start("w2", extproc_argv=(*serve, "--workers", "2")),
        "1 worker asyncio": await stacks.start(
            "w1a", extproc_argv=serve, env={"AIQ_EVENT_LOOP": "asyncio"}
        ),
    }
    for s in variants.values():
        await batch(s.base_url, KEY, Shape(), count=20, concurrency=4)
    await workers(b, variants)


SCENARIO = Scenario("workers", measure)
