"""Section 2, streaming overhead: TTFT and inter-chunk delay against the baseline listener and
the do-nothing floor processor (:mod:`extproc.bench.floor`), and processor CPU per chunk, per
gRPC message and per stream (derived) compared with the floor.

Per chunk and per message come from two stream lengths (``cost = fixed + per_chunk x chunks``);
the fixed part this split gives is only indicative (a small difference of two large CPU
figures, 10 ms ticks): the per-request part is measured directly in section 1
(:func:`extproc.bench.scenarios.admission.cpu_per_request`)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, US, batch, interleave, med_rounds, pct_ms
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target, per_unit_split
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack

#: Issue 17's target: processor CPU per streamed chunk against the floor's.
PER_CHUNK_RATIO = 1.3


async def streaming(b: Bench, main: Stack, baseline_url: str, floor: Stack) -> None:
    """TTFT and inter-chunk delay at concurrency 1; processor CPU per chunk vs the floor."""
    raw: dict[str, Any] = {}
    urls = {"baseline": baseline_url, "gateway": main.base_url, "floor": floor.base_url}
    for chunks, count in ((50, b.plan.short_streams_lat), (500, b.plan.long_streams_lat)):
        shape = Shape(prompt_tokens=100, max_tokens=chunks, stream=True, itl_ms=1)
        b.log(f"streaming latency: {chunks} chunks, {count} streams per arm x {b.plan.rounds}")
        res = await interleave(
            b.plan.rounds,
            {
                arm: partial(batch, u, KEY, shape, count=count, concurrency=1)
                for arm, u in urls.items()
            },
        )
        ttft = {arm: med_rounds([pct_ms(r, 50, "ttft") for r in rs]) for arm, rs in res.items()}
        gap = {arm: med_rounds([pct_ms(r, 50, "mean_gap") for r in rs]) for arm, rs in res.items()}
        incomplete = {arm: sum(1 for r in rs for x in r if not x.done) for arm, rs in res.items()}
        raw[f"latency_{chunks}"] = {"ttft_ms": ttft, "mean_gap_ms": gap, "incomplete": incomplete}
        b.table.add(
            Row(
                "2 streaming", f"TTFT p50, {chunks} chunks", "ms", ttft["gateway"], ttft["baseline"]
            )
        )
        b.table.add(
            Row(
                "2 streaming",
                f"mean inter-chunk, {chunks} chunks",
                "ms",
                gap["gateway"],
                gap["baseline"],
            )
        )
        b.table.add(
            Row(
                "2 streaming",
                f"mean inter-chunk, {chunks} chunks, floor processor",
                "ms",
                gap["floor"],
                gap["baseline"],
            )
        )

    # CPU per chunk from two stream lengths, real vs floor, interleaved.
    procs = {
        "gateway": (main, system.proc_pids(main, "extproc")),
        "floor": (floor, system.proc_pids(floor, "extproc")),
    }
    conc = b.plan.cpu_concurrency
    m = b.plan.cpu_streams
    lengths = (50, 500)
    b.log(f"processor CPU: {m} streams of {lengths} chunks at c={conc}, x {b.plan.rounds}")

    async def cpu_round(arm: str) -> dict[str, float]:
        stack, pids = procs[arm]
        meter = system.CpuMeter(pids)
        out: dict[str, float] = {}
        for chunks in lengths:
            shape = Shape(prompt_tokens=100, max_tokens=chunks, stream=True, itl_ms=1)
            before = system.envoy_counters(stack.ports.envoy_admin)
            meter.start()
            rs = await batch(stack.base_url, KEY, shape, count=m, concurrency=conc)
            await asyncio.sleep(0.15)  # settlements run after the response ends
            cpu = meter.stop()
            after = system.envoy_counters(stack.ports.envoy_admin)
            sent = sum(after[k] - before.get(k, 0) for k in after if k.endswith("stream_msgs_sent"))
            out[f"cpu_per_req_{chunks}"] = cpu / max(1, len(rs))
            out[f"msgs_per_req_{chunks}"] = sent / max(1, len(rs))
            out[f"tokens_per_req_{chunks}"] = sum(r.tokens for r in rs) / max(1, len(rs))
        fixed, per_chunk = per_unit_split(
            out["cpu_per_req_50"],
            out["cpu_per_req_500"],
            out["tokens_per_req_50"],
            out["tokens_per_req_500"],
        )
        _, per_msg = per_unit_split(
            out["cpu_per_req_50"],
            out["cpu_per_req_500"],
            out["msgs_per_req_50"],
            out["msgs_per_req_500"],
        )
        out.update(fixed=fixed, per_chunk=per_chunk, per_msg=per_msg)
        return out

    cpu = await interleave(b.plan.rounds, {a: partial(cpu_round, a) for a in procs})
    med = {arm: {k: med_rounds([r[k] for r in rs]) for k in rs[0]} for arm, rs in cpu.items()}
    raw["cpu"] = {"rounds": cpu, "median": med}
    b.raw["streaming"] = raw

    def us(x: float | None) -> float | None:
        return None if x is None else x * US

    b.table.add(
        Row(
            "2 streaming",
            "processor CPU per chunk (base = floor)",
            "µs",
            us(med["gateway"]["per_chunk"]),
            us(med["floor"]["per_chunk"]),
            goal=Target("ratio", "<=", PER_CHUNK_RATIO),
        )
    )
    b.table.add(
        Row(
            "2 streaming",
            "processor CPU per gRPC message (base = floor)",
            "µs",
            us(med["gateway"]["per_msg"]),
            us(med["floor"]["per_msg"]),
        )
    )
    b.table.add(
        Row(
            "2 streaming",
            "processor CPU per stream, fixed part, derived from 50/500 chunks (base = floor)",
            "µs",
            us(med["gateway"]["fixed"]),
            us(med["floor"]["fixed"]),
        )
    )
    b.table.add(
        Row(
            "2 streaming",
            "gRPC messages Envoy sent per 500-chunk stream",
            "msgs",
            med["gateway"]["msgs_per_req_500"],
            med["floor"]["msgs_per_req_500"],
        )
    )


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack and the floor stack."""
    await streaming(b, stacks.shared, stacks.baseline_url, await stacks.shared_floor())


SCENARIO = Scenario("streaming", measure, on_main=True)
