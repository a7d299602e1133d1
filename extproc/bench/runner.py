"""The benchmark scenarios.  Each compares the gateway with a baseline measured in the same
run, alternating the two (A B A B ...) for several rounds and keeping the medians.

Stacks (all on free loopback ports, started with :mod:`extproc.stack`):

* ``main``: Redis, simulator, one real processor, one Envoy with the filtered listener and a
  baseline listener without the filter (the same Envoy);
* ``floor``: simulator, the do-nothing processor (:mod:`extproc.bench.floor`), one Envoy;
* ``accuracy``: 2 Envoys x 2 processor replicas, one Redis;
* ``workers``: one Envoy each in front of ``serve --workers 1``, ``--workers 2`` and
  ``--workers 1`` on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson

from extproc.bench import system
from extproc.bench.client import Result, Shape, connector, send
from extproc.bench.report import Row, Table, Target, per_unit_split
from extproc.sim.records import SimRecord
from extproc.stack import Stack
from extproc.stats import median, percentile

T = TypeVar("T")
MS = 1000.0
US = 1_000_000.0


@dataclass(frozen=True)
class BenchPlan:
    """How much to measure (``quick`` shrinks every count)."""

    rounds: int = 5
    admit_c1: int = 200
    admit_c16: int = 800
    short_streams_lat: int = 8
    long_streams_lat: int = 2
    cpu_streams: int = 16
    cpu_concurrency: int = 4
    tok_e2e: int = 20
    acc_concurrency: int = 64
    acc_limit: int = 20_000
    every: int = 64
    worker_rounds: int = 3
    worker_seconds: float = 2.5
    worker_concurrency: int = 32
    profile_seconds: float = 5.0
    soak_seconds: float = 60.0

    @classmethod
    def quick(cls) -> BenchPlan:
        """About one minute in all."""
        return cls(
            rounds=3,
            admit_c1=60,
            admit_c16=240,
            short_streams_lat=4,
            long_streams_lat=1,
            cpu_streams=8,
            tok_e2e=8,
            worker_rounds=2,
            worker_seconds=1.5,
            profile_seconds=3.0,
            soak_seconds=20.0,
        )


@dataclass
class Bench:
    """One run: the plan, the table being filled and the raw figures behind it."""

    plan: BenchPlan
    workdir: Path
    sections: frozenset[str]
    table: Table = field(default_factory=Table)
    raw: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
    _ids: int = 0

    def rid(self, prefix: str) -> str:
        """A fresh client request id."""
        self._ids += 1
        return f"bench-{prefix}-{self._ids}"


# -- load helpers ---------------------------------------------------------------------------


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
    rounds: int, arms: dict[str, Callable[[], Awaitable[T]]]
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


KEY = "sk-bench"


# -- 1. admission overhead ------------------------------------------------------------------


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


# -- 2. streaming overhead and processor CPU ------------------------------------------------


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
            goal=Target("ratio", "<=", 1.2),
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
            "processor CPU per request, fixed part (base = floor)",
            "µs",
            us(med["gateway"]["fixed"]),
            us(med["floor"]["fixed"]),
            goal=Target("ratio", "<=", 1.35),
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


# -- 3. Redis round trips -------------------------------------------------------------------


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


# -- 4. tokenizer ---------------------------------------------------------------------------


def tokenizer_inprocess(b: Bench) -> dict[str, float]:
    """Median time of ``count_chat_request`` with the cl100k counter at 1k and 32k tokens."""
    from extproc.core.tokens import TokenizerSpec, count_chat_request
    from extproc.tokenizers import load_counter

    spec = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")
    counter = load_counter(spec)
    out: dict[str, float] = {}
    for tokens, reps in ((1000, 200), (32000, 10)):
        body = orjson.loads(Shape(prompt_tokens=tokens).body(1))
        count_chat_request(body, counter, spec)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                count_chat_request(body, counter, spec)
            samples.append((time.perf_counter() - t0) / reps)
        out[f"count_{tokens}_us"] = (median(samples) or 0.0) * US
        out[f"tokens_{tokens}"] = float(count_chat_request(body, counter, spec))
    return out


async def tokenizer(b: Bench, main: Stack, baseline_url: str) -> None:
    """In-process counting cost, and end-to-end latency at 32k vs 1k prompt tokens."""
    inproc = tokenizer_inprocess(b)
    b.table.add(
        Row("4 tokenizer", "count_chat_request, 1k-token prompt", "µs", inproc["count_1000_us"])
    )
    b.table.add(
        Row("4 tokenizer", "count_chat_request, 32k-token prompt", "µs", inproc["count_32000_us"])
    )
    n = b.plan.tok_e2e
    b.log(f"tokenizer end to end: {n} requests of 1k and 32k per arm x {b.plan.rounds}")
    small, big = Shape(prompt_tokens=1000, max_tokens=8), Shape(prompt_tokens=32000, max_tokens=8)
    res = await interleave(
        b.plan.rounds,
        {
            "baseline_1k": lambda: batch(baseline_url, KEY, small, count=n, concurrency=1),
            "gateway_1k": lambda: batch(main.base_url, KEY, small, count=n, concurrency=1),
            "baseline_32k": lambda: batch(baseline_url, KEY, big, count=n, concurrency=1),
            "gateway_32k": lambda: batch(main.base_url, KEY, big, count=n, concurrency=1),
        },
    )
    p50 = {arm: med_rounds([pct_ms(r, 50) for r in rs]) for arm, rs in res.items()}
    b.raw["tokenizer"] = {"in_process": inproc, "p50_ms": p50}
    b.table.add(
        Row(
            "4 tokenizer",
            "latency p50, 32k-token prompt",
            "ms",
            p50["gateway_32k"],
            p50["baseline_32k"],
        )
    )

    def sub(a: float | None, c: float | None) -> float | None:
        return None if a is None or c is None else a - c

    b.table.add(
        Row(
            "4 tokenizer",
            "latency p50, 32k minus 1k prompt",
            "ms",
            sub(p50["gateway_32k"], p50["gateway_1k"]),
            sub(p50["baseline_32k"], p50["baseline_1k"]),
        )
    )


# -- 5 + 6. accuracy under load and upstream stop latency ----------------------------------


_sim_records = system.sim_records


async def _wait_window(b: Bench, seconds: float = 45.0) -> None:
    left = 3600 - time.time() % 3600
    if left < seconds:
        b.log(f"waiting {left:.0f}s for the next hourly window")
        await asyncio.sleep(left + 1)


#: Micro-dollars per input and output token in the bench rules' price table ($1 and $4 per
#: million); a budget tenant's limit is worth ``acc_limit`` output tokens.
PRICE_IN, PRICE_OUT = 1, 4


async def accuracy(b: Bench, stack: Stack) -> None:
    """Many concurrent streams of one tenant until its quota runs out: a TPM limit and a money
    budget, each lazy and strict (judged on what reached clients, in the limit's own units)."""
    from extproc.config import load_config
    from extproc.core.tokens import count_chat_request

    cfg = load_config(stack.config)
    model = cfg.models["sim-small"]
    limit = b.plan.acc_limit
    conc = b.plan.acc_concurrency
    shape = Shape(prompt_tokens=100, max_tokens=1000, stream=True, itl_ms=5)
    raw: dict[str, Any] = {}
    stops: list[float] = []
    gaps: list[float] = []
    for mode in ("lazy", "strict", "budget-lazy", "budget-strict"):
        money = mode.startswith("budget")
        # in the limit's units: tokens, or micro-dollars at the bench's prices
        p_in, p_out = (PRICE_IN, PRICE_OUT) if money else (1, 1)
        limit = b.plan.acc_limit * (PRICE_OUT if money else 1)
        await _wait_window(b)
        window = int(time.time() // 3600)
        b.log(
            f"accuracy ({mode}): {conc} streams through 2 Envoys x 2 processors, "
            f"limit {limit} {'micro-dollars' if money else 'tokens'} per window"
        )
        results: list[tuple[Result, int]] = []
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=connector(conc)) as session:

            async def worker(
                i: int,
                mode: str = mode,
                started: float = started,
                results: list[tuple[Result, int]] = results,
            ) -> None:
                url = f"http://127.0.0.1:{stack.envoy_ports[i % 2]}/v1"
                for j in range(4):
                    if time.monotonic() - started > 40:
                        return
                    n = i * 10 + j
                    body = shape.body(n)
                    prompt = count_chat_request(orjson.loads(body), model.counter, model.tokenizer)
                    r = await send(
                        session,
                        url,
                        f"sk-{mode}",
                        shape,
                        body=body,
                        client_request_id=b.rid(mode),
                        limit_s=45,
                    )
                    results.append((r, prompt))
                    if r.status != 200 or r.cut:
                        return

            await asyncio.gather(*(worker(i) for i in range(conc)))
        elapsed = time.monotonic() - started
        # Ground truth: wait for the simulator to finish every record of this run.
        ids = {r.client_request_id for r, _ in results}
        recs: dict[str, SimRecord] = {}
        for _ in range(30):
            recs = {
                x.client_request_id: x
                for x in _sim_records(stack.sim_url)
                if x.client_request_id in ids
            }
            if all(x.finished for x in recs.values()):
                break
            await asyncio.sleep(0.2)
        admitted = [(r, p) for r, p in results if r.status == 200]
        prompt_total = sum(p for _, p in admitted)
        delivered = sum(r.tokens for r, _ in admitted)
        upstream = sum(
            recs[r.client_request_id].tokens_sent
            for r, _ in admitted
            if r.client_request_id in recs
        )
        same_window = int(time.time() // 3600) == window
        used_client = prompt_total * p_in + delivered * p_out
        used_upstream = prompt_total * p_in + upstream * p_out
        # lazy: the hard cap is 2N uncharged tokens per stream (the meter holds events there);
        # typically about N, plus what flows while a charge is in flight
        bound = 0 if mode.endswith("strict") else 2 * b.plan.every * conc * p_out
        over_client = used_client - limit
        over_upstream = used_upstream - limit
        cut = [r for r, _ in admitted if r.cut]
        for r in cut:
            rec = recs.get(r.client_request_id)
            if rec and rec.disconnected_at and r.cut_wall:
                stops.append((rec.disconnected_at - r.cut_wall) * MS)
                if rec.last_token_at:
                    gaps.append((rec.disconnected_at - rec.last_token_at) * MS)
        raw[mode] = {
            "limit": limit,
            "requests": len(results),
            "admitted": len(admitted),
            "refused": sum(1 for r, _ in results if r.status == 429),
            "failed": sum(1 for r, _ in results if r.status not in (200, 429)),
            "cut": len(cut),
            "incomplete": sum(1 for r, _ in admitted if not r.done),
            "prompt_tokens": prompt_total,
            "delivered_client": delivered,
            "sent_upstream": upstream,
            "used_client": used_client,
            "used_upstream": used_upstream,
            "overshoot_client": over_client,
            "overshoot_upstream": over_upstream,
            "bound": bound,
            "utilisation": used_client / limit,
            "elapsed_s": elapsed,
            "same_window": same_window,
            "endings": dict(Counter(x.ending for x in recs.values())),
        }
        # Both modes are judged on what reached clients (what the counters charge); the
        # upstream figure also counts tokens generated after the cut and never delivered.
        over = over_client
        unit = "µUSD" if money else "tokens"
        row = b.table.add(
            Row(
                "5 accuracy",
                f"{mode}: overshoot ({conc} streams, N={b.plan.every})",
                unit,
                float(over),
                goal=Target("value", "<=", bound, unit),
                note=f"upstream {over_upstream:+d}, client {over_client:+d}",
            )
        )
        row.met = bool(row.met) and same_window
        b.table.add(
            Row(
                "5 accuracy",
                f"{mode}: utilisation (delivered+prompt)/limit",
                "%",
                100.0 * used_client / limit,
                goal=Target("value", ">=", 95, "%") if mode.endswith("strict") else None,
            )
        )
    raw["window_boundary"] = await window_boundary(b, stack)
    b.raw["accuracy"] = raw
    b.raw["stop_latency"] = {"cut_to_disconnect_ms": stops, "last_token_to_disconnect_ms": gaps}
    for name, xs in (
        ("client error event -> upstream disconnect", stops),
        ("upstream last token -> disconnect", gaps),
    ):
        for q in (50, 99):
            row = b.table.add(
                Row(
                    "6 stop",
                    f"{name} p{q} (n={len(xs)})",
                    "ms",
                    percentile(xs, q),
                    goal=Target("value", "<", 50, "ms"),
                )
            )


async def window_boundary(b: Bench, stack: Stack) -> dict[str, Any]:
    """Requests admitted in the worst one-second span across a window boundary, fixed versus
    sliding windows (limit ``BOUNDARY_RPS`` per second), with demand far above the limit in
    the half second on each side of the boundary."""
    limit = system.BOUNDARY_RPS
    out: dict[str, Any] = {}
    shape = Shape(prompt_tokens=10, max_tokens=1)
    for kind in ("fixed", "sliding"):
        # start 0.5 s before a whole second (window boundary), send for one second
        await asyncio.sleep(1.5 - time.time() % 1.0)
        end = time.time() + 1.0
        admitted: list[float] = []
        async with aiohttp.ClientSession(connector=connector(16)) as session:

            async def worker(
                i: int, kind: str = kind, admitted: list[float] = admitted, end: float = end
            ) -> None:
                url = f"http://127.0.0.1:{stack.envoy_ports[i % 2]}/v1"
                while time.time() < end:
                    sent = time.time()
                    r = await send(session, url, f"sk-{kind}", shape, limit_s=5)
                    if r.status == 200:
                        admitted.append(sent)

            await asyncio.gather(*(worker(i) for i in range(16)))
        admitted.sort()
        worst = max(
            (sum(1 for t in admitted[i:] if t - start < 1.0) for i, start in enumerate(admitted)),
            default=0,
        )
        out[kind] = {"admitted": len(admitted), "worst_1s": worst, "limit": limit}
        b.table.add(
            Row(
                "5 accuracy",
                f"{kind} window: most admitted in any 1 s across a boundary (limit {limit}/s)",
                "x limit",
                worst / limit,
                goal=Target("value", "<=", 1.6) if kind == "sliding" else None,
                note=f"{worst} of {len(admitted)} admitted",
            )
        )
    return out


# -- 7. workers and event loops ------------------------------------------------------------


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


# -- 8. profile ------------------------------------------------------------------------------


def _pyspy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def parse_pyspy_raw(text: str) -> tuple[Counter[str], Counter[str], Counter[str], int]:
    """Own-time samples per function, inclusive samples per function and own-time samples per
    module (Python file or native library) from py-spy's ``--format raw`` output."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    mods: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        n = int(count_s)
        total += n
        frames = [_frame_name(f) for f in stack.split(";")]
        own[frames[-1]] += n
        mods[_module(frames[-1])] += n
        for f in set(frames):
            incl[f] += n
    return own, incl, mods, total


def _module(frame: str) -> str:
    """``func (file.py)`` → ``file.py``; native frames keep their library name."""
    _, _, where = frame.rpartition(" (")
    return where.rstrip(")") or frame


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` → ``func (dir/file.py)``."""
    func, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path = where.rsplit(":", 1)[0] if where.endswith(tuple("0123456789")) else where
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{func} ({short})"


async def profile(b: Bench, main: Stack) -> None:
    """py-spy on the real processor while it meters 500-chunk streams.  Without ``--native``
    (which needs blocking sampling and shows mostly idle libc waits here) time spent in C
    extensions is charged to the Python frame that called them."""
    spy = _pyspy()
    if spy is None:
        b.raw["profile"] = {"skipped": "py-spy not installed (pip install py-spy)"}
        b.log("profile: skipped, py-spy is not installed")
        return
    pid = system.proc_pids(main, "extproc")[0]
    rate = 250
    out = b.workdir / "pyspy.txt"
    secs = b.plan.profile_seconds
    b.log(f"profile: py-spy {secs}s at {rate} Hz on pid {pid}")
    proc = await asyncio.create_subprocess_exec(
        spy,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--nonblocking",
        "--duration",
        str(int(secs)),
        "--output",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await asyncio.sleep(0.5)
    shape = Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1)
    rs, _ = await timed(
        main.base_url, KEY, shape, seconds=secs - 0.5, concurrency=b.plan.cpu_concurrency
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), secs + 20)
    except TimeoutError:
        proc.kill()
        err = b"timeout"
    if proc.returncode != 0 or not out.exists():
        b.raw["profile"] = {"skipped": f"py-spy failed: {err.decode(errors='replace')[-300:]}"}
        return
    own, incl, mods, total = parse_pyspy_raw(out.read_text())
    chunks = sum(r.tokens for r in rs)
    us_per_sample = US / rate

    def table(c: Counter[str], k: int) -> list[dict[str, Any]]:
        return [
            {
                "function": f,
                "samples": n,
                "share": n / max(1, total),
                "us_per_chunk": n * us_per_sample / max(1, chunks),
            }
            for f, n in c.most_common(k)
        ]

    b.raw["profile"] = {
        "rate_hz": rate,
        "samples": total,
        "chunks": chunks,
        "cpu_us_per_chunk_sampled": total * us_per_sample / max(1, chunks),
        "own": table(own, 30),
        "own_by_module": table(mods, 20),
        "inclusive_extproc": table(
            Counter(
                {
                    f: n
                    for f, n in incl.items()
                    if "extproc" in f or "server/" in f or "core/" in f or "limiter/" in f
                }
            ),
            20,
        ),
    }
    for item in b.raw["profile"]["own"][:5]:
        b.table.add(
            Row(
                "8 profile",
                f"own time: {item['function']}",
                "µs/chunk",
                item["us_per_chunk"],
                note=f"{100 * item['share']:.0f}% of samples",
            )
        )
    wanted = ("ExternalProcessorServicer.Process ", "RequestProcessor.handle ")
    for item in b.raw["profile"]["inclusive_extproc"]:
        if not item["function"].startswith(wanted):
            continue
        b.table.add(
            Row(
                "8 profile",
                f"inclusive: {item['function']}",
                "µs/chunk",
                item["us_per_chunk"],
                note=f"{100 * item['share']:.0f}% of samples",
            )
        )


# -- the whole run ---------------------------------------------------------------------------

SECTIONS = (
    "admission",
    "streaming",
    "redis",
    "tokenizer",
    "accuracy",
    "workers",
    "profile",
    "rolling",
    "soak",
)


async def run(b: Bench) -> None:
    """Start the stacks the chosen sections need, measure, stop everything."""
    rules = system.bench_rules(every=b.plan.every, tpm_limit=b.plan.acc_limit)
    py = sys.executable
    want = b.sections
    stacks: list[Stack] = []

    def started(s: Stack) -> Stack:
        stacks.append(s)
        return s

    try:
        if want & {"admission", "streaming", "redis", "tokenizer", "profile"}:
            b.log("starting the main stack (Envoy with baseline listener) and the floor stack")
            main = started(
                await asyncio.to_thread(
                    system.start_stack, b.workdir / "main", rules, baseline=True
                )
            )
            baseline_url = f"http://127.0.0.1:{main.baseline_port}/v1"
            await batch(main.base_url, KEY, Shape(), count=30, concurrency=4)
            await batch(baseline_url, KEY, Shape(), count=30, concurrency=4)
            if "admission" in want:
                await admission(b, main, baseline_url)
            if "streaming" in want:
                floor = started(
                    await asyncio.to_thread(
                        system.start_stack,
                        b.workdir / "floor",
                        rules,
                        extproc_argv=(py, "-m", "extproc.bench.floor"),
                        redis_url=main.effective_redis_url,
                    )
                )
                await batch(
                    floor.base_url, KEY, Shape(stream=True, max_tokens=20), count=20, concurrency=4
                )
                await streaming(b, main, baseline_url, floor)
                floor.stop()
            if "redis" in want:
                await round_trips(b, main)
            if "tokenizer" in want:
                await tokenizer(b, main, baseline_url)
            if "profile" in want:
                await profile(b, main)
            main.stop()
        if "accuracy" in want:
            b.log("starting the accuracy stack (2 Envoys x 2 processors)")
            acc = started(
                await asyncio.to_thread(
                    system.start_stack, b.workdir / "accuracy", rules, envoys=2, extprocs=2
                )
            )
            await accuracy(b, acc)
            acc.stop()
        if "workers" in want:
            b.log("starting the worker stacks")
            serve = (py, "-m", "extproc", "serve")
            variants = {
                "1 worker uvloop": started(
                    await asyncio.to_thread(
                        system.start_stack,
                        b.workdir / "w1",
                        rules,
                        extproc_argv=serve,
                        baseline=True,
                    )
                ),
                "2 workers uvloop": started(
                    await asyncio.to_thread(
                        system.start_stack,
                        b.workdir / "w2",
                        rules,
                        extproc_argv=(*serve, "--workers", "2"),
                    )
                ),
                "1 worker asyncio": started(
                    await asyncio.to_thread(
                        system.start_stack,
                        b.workdir / "w1a",
                        rules,
                        extproc_argv=serve,
                        env={"AIQ_EVENT_LOOP": "asyncio"},
                    )
                ),
            }
            for s in variants.values():
                await batch(s.base_url, KEY, Shape(), count=20, concurrency=4)
            await workers(b, variants)
        if "rolling" in want:
            from extproc.bench.rolling import bench_section

            b.log("starting the rolling-restart stack (1 Envoy x 2 processors)")
            roll = started(
                await asyncio.to_thread(
                    system.start_stack, b.workdir / "rolling", rules, extprocs=2
                )
            )
            await bench_section(b, roll, KEY)
            roll.stop()
        if "soak" in want:
            from extproc.bench import soak

            b.log("starting the soak stack (1 Envoy x 1 processor)")
            st = started(
                await asyncio.to_thread(
                    system.start_stack,
                    b.workdir / "soak",
                    rules,
                    # ground truth for every request (about 350 a second on two cores)
                    sim_max_records=int(b.plan.soak_seconds * 600) + 10_000,
                )
            )
            await soak.bench_section(b, st, b.plan.soak_seconds)
            st.stop()
    finally:
        for s in reversed(stacks):
            with contextlib.suppress(Exception):
                s.stop()


def new_workdir() -> Path:
    """A scratch directory for the stacks' logs and configs."""
    return Path(tempfile.mkdtemp(prefix="aiq-bench-"))
