"""Section 1, admission overhead: non-streaming latency through the filtered listener versus
the same Envoy's listener without the filter, at concurrency 1 and 16; and the processor CPU
per non-streaming request measured directly against the do-nothing floor processor."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, US, batch, interleave, med_rounds, ok_count, pct_ms
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack
from extproc.stats import median

#: The admission shape: a 1k-token prompt, 8 output tokens, not streamed.
SHAPE = Shape(prompt_tokens=1000, max_tokens=8)
#: Issue 17's targets: added p50 at c=1, and the processor's CPU per non-streaming request
#: (its fixed per-request part) against the floor's.
ADDED_P50_C1_MS = 2.5
FIXED_CPU_RATIO = 1.8
#: Quiet time after a CPU batch, inside the measurement: the gateway settles in the
#: background (a batch every few ms), after the last response has reached the client.
SETTLE_S = 0.15


async def admission(b: Bench, main: Stack, baseline_url: str, floor: Stack | None = None) -> None:
    """Non-streaming, 1k-token prompt, filtered listener vs the same Envoy's baseline listener;
    with ``floor``, the do-nothing processor's listener too (what the ext_proc messages alone
    add: the part of the gateway's added latency no processor work can take away)."""
    raw: dict[str, Any] = b.raw.setdefault("admission", {})
    for c, n in ((1, b.plan.admit_c1), (16, b.plan.admit_c16)):
        b.log(f"admission: concurrency {c}, {n} requests per arm x {b.plan.rounds} rounds")
        arms = {
            "baseline": partial(batch, baseline_url, KEY, SHAPE, count=n, concurrency=c),
            "gateway": partial(batch, main.base_url, KEY, SHAPE, count=n, concurrency=c),
        }
        if floor is not None:
            arms["floor"] = partial(batch, floor.base_url, KEY, SHAPE, count=n, concurrency=c)
        res = await interleave(b.plan.rounds, arms)
        summary: dict[str, Any] = {}
        for q in (50, 99):
            figs = {arm: med_rounds([pct_ms(r, q) for r in res[arm]]) for arm in arms}
            base, gw = figs["baseline"], figs["gateway"]
            summary[f"p{q}"] = figs
            goal = Target("delta", "<=", ADDED_P50_C1_MS, "ms") if (q, c) == (50, 1) else None
            b.table.add(Row("1 admission", f"latency p{q}, c={c}", "ms", gw, base, goal=goal))
            if "floor" in figs:
                b.table.add(
                    Row(
                        "1 admission",
                        f"latency p{q}, c={c}, floor processor (base = no filter)",
                        "ms",
                        figs["floor"],
                        base,
                    )
                )
        summary["errors"] = {arm: sum(len(r) - ok_count(r) for r in rs) for arm, rs in res.items()}
        raw[f"c{c}"] = summary


async def cpu_per_request(b: Bench, main: Stack, floor: Stack) -> None:
    """Processor CPU per non-streaming request, gateway vs the do-nothing floor, measured
    directly: per arm and round a batch of requests, the CPU of the processor's process tree
    over the batch divided by its requests (enough requests that 10 ms ticks do not matter)."""
    arms = {"gateway": main, "floor": floor}
    meters = {arm: system.CpuMeter(system.proc_pids(s, "extproc")) for arm, s in arms.items()}
    n, c = b.plan.fixed_requests, b.plan.fixed_concurrency
    b.log(f"processor CPU per non-streaming request: {n} at c={c} per arm x {b.plan.rounds}")

    async def one_round(arm: str) -> dict[str, float]:
        stack, meter = arms[arm], meters[arm]
        before = system.envoy_counters(stack.ports.envoy_admin)
        meter.start()
        rs = await batch(stack.base_url, KEY, SHAPE, count=n, concurrency=c)
        await asyncio.sleep(SETTLE_S)
        cpu = meter.stop()
        after = system.envoy_counters(stack.ports.envoy_admin)
        sent = sum(after[k] - before.get(k, 0) for k in after if k.endswith("stream_msgs_sent"))
        done = max(1, len(rs))
        return {
            "requests": float(len(rs)),
            "errors": float(len(rs) - ok_count(rs)),
            "cpu_s": cpu,
            "cpu_per_req_us": cpu / done * US,
            "msgs_per_req": sent / done,
        }

    rounds = await interleave(b.plan.rounds, {a: partial(one_round, a) for a in arms})
    summary = cpu_summary(rounds)
    b.raw.setdefault("admission", {})["cpu"] = {
        "shape": {"prompt_tokens": SHAPE.prompt_tokens, "max_tokens": SHAPE.max_tokens},
        "requests_per_round": n,
        "concurrency": c,
        "rounds": rounds,
        **summary,
    }
    for row in cpu_rows(summary):
        b.table.add(row)


def cpu_summary(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per arm the median of each per-round figure; the gateway / floor CPU ratio of each
    round (the arms alternate, so a round's two batches saw about the same machine); failed
    requests per arm."""
    med = {arm: {k: med_rounds([r[k] for r in rs]) for k in rs[0]} for arm, rs in rounds.items()}
    ratios = [
        g["cpu_per_req_us"] / f["cpu_per_req_us"]
        for g, f in zip(rounds["gateway"], rounds["floor"], strict=True)
        if f["cpu_per_req_us"] > 0
    ]
    errors = {arm: int(sum(r["errors"] for r in rs)) for arm, rs in rounds.items()}
    return {"median": med, "ratio_per_round": ratios, "errors": errors}


def cpu_rows(summary: dict[str, Any]) -> list[Row]:
    """The table rows of :func:`cpu_summary`: CPU per request with issue 17's target and the
    spread of the per-round ratios, and the ext_proc messages per request of each arm (the
    floor must exchange as many as the gateway for the comparison to hold)."""
    med, ratios, errors = summary["median"], summary["ratio_per_round"], summary["errors"]
    spread = (
        f"ratio per round: median {median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x"
        if ratios
        else ""
    )
    failed = f"failed: gateway {errors['gateway']}, floor {errors['floor']}"
    return [
        Row(
            "1 admission",
            "processor CPU per non-streaming request (base = floor)",
            "µs",
            med["gateway"]["cpu_per_req_us"],
            med["floor"]["cpu_per_req_us"],
            goal=Target("ratio", "<=", FIXED_CPU_RATIO),
            note=", ".join(x for x in (spread, failed if any(errors.values()) else "") if x),
        ),
        Row(
            "1 admission",
            "gRPC messages Envoy sent per non-streaming request (base = floor)",
            "msgs",
            med["gateway"]["msgs_per_req"],
            med["floor"]["msgs_per_req"],
        ),
    ]


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack, and the floor stack for the CPU comparison."""
    floor = await stacks.shared_floor()
    await admission(b, stacks.shared, stacks.baseline_url, floor)
    await cpu_per_request(b, stacks.shared, floor)


SCENARIO = Scenario("admission", measure, on_main=True)
