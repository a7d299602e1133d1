"""Section 10, scale: ``serve --workers N`` for N = 1, 2, 4 ... up to this machine's cores,
with local allowances off and on, for one busy tenant and for 64 tenants: non-streaming req/s
and streamed chunks/s at a fixed concurrency, CPU per request and per chunk of each component
(processor workers, Envoy, simulator, Redis), and Redis round trips per request (INFO
commandstats).

Each variant runs on a stack of its own (its own Redis, so Redis CPU is the variant's), started
when measured and stopped after, so variants do not share cores.  The load comes from
``extproc.bench.load_proc`` processes (one per two cores, ``AIQ_BENCH_CLIENTS``; asyncio, one
connection per concurrent request), their CPU reported as the ``clients`` component, and the
simulator runs as one process per four cores sharing its port (``AIQ_BENCH_SIMS``), so that
on a many-core machine neither is what saturates.  ``AIQ_BENCH_SCALE_MAX_WORKERS`` caps N and
``AIQ_BENCH_SCALE_CONCURRENCY`` sets the concurrency (``scripts/bench-device`` runs this
section on a machine without network)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from typing import Any

import aiohttp
import orjson

from extproc.bench import system
from extproc.bench.client import Result, Shape, connector, send
from extproc.bench.drivers import KEY, batch
from extproc.bench.plan import Bench
from extproc.bench.report import Row
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack

#: The tenants of the 64-tenant runs (system.bench_rules: t-scale0 .. t-scale63).
SCALE_KEYS = tuple(f"sk-scale{i}" for i in range(system.SCALE_TENANTS))
COMPONENTS = ("extproc", "envoy", "sim", "redis")


def worker_counts(cores: int) -> list[int]:
    """1, 2, 4, 8 ... up to ``cores`` (1 on a one-core machine)."""
    out, n = [], 1
    while n <= max(1, cores):
        out.append(n)
        n *= 2
    return out


async def timed_keys(
    url: str,
    keys: tuple[str, ...],
    shape: Shape,
    *,
    seconds: float,
    concurrency: int,
    offset: int = 0,
) -> tuple[list[Result], float]:
    """Closed loop for ``seconds`` (at most 100,000 requests), the requests spread over
    ``keys`` in turn (numbered from ``offset``: their prompts differ)."""
    out: list[Result] = []
    started = time.perf_counter()
    stop_at = started + seconds
    sent = offset
    last = offset + 100_000
    async with aiohttp.ClientSession(connector=connector(concurrency)) as session:

        async def worker() -> None:
            nonlocal sent
            while time.perf_counter() < stop_at and sent < last:
                sent += 1
                key = keys[sent % len(keys)]
                out.append(await send(session, url, key, shape, body=shape.body(sent)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, time.perf_counter() - started


def client_count(cores: int) -> int:
    """Load-client processes by default: one per two cores (at least one)."""
    return max(1, cores // 2)


async def load_clients(
    st: Stack,
    keys: tuple[str, ...],
    shape: Shape,
    *,
    seconds: float,
    concurrency: int,
    clients: int,
) -> tuple[list[asyncio.subprocess.Process], list[int]]:
    """Start ``clients`` load-client processes (extproc.bench.load_proc) sharing
    ``concurrency``; returned once each said it is ready (not started yet)."""
    clients = max(1, min(clients, concurrency))
    shape_json = orjson.dumps(dataclasses.asdict(shape)).decode()
    procs: list[asyncio.subprocess.Process] = []
    for i in range(clients):
        share = concurrency // clients + (1 if i < concurrency % clients else 0)
        argv = ["-m", "extproc.bench.load_proc", "--url", st.base_url, "--keys", ",".join(keys)]
        argv += ["--shape", shape_json, "--seconds", str(seconds)]
        argv += ["--concurrency", str(share), "--offset", str(i * 100_000)]
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        )
    for p in procs:
        assert p.stdout is not None
        line = await asyncio.wait_for(p.stdout.readline(), timeout=60)
        if line.strip() != b"ready":
            raise RuntimeError(f"a load client did not start: {line!r}")
    return procs, [p.pid for p in procs]


async def run_one(
    st: Stack,
    keys: tuple[str, ...],
    shape: Shape,
    *,
    seconds: float,
    concurrency: int,
    clients: int = 1,
) -> dict[str, Any]:
    """One timed run with ``clients`` load-client processes: throughput, CPU per request
    (µs) per component (the load clients' too), Redis calls per request, and for streams
    chunks/s and CPU per chunk."""
    procs, pids = await load_clients(
        st, keys, shape, seconds=seconds, concurrency=concurrency, clients=clients
    )
    try:
        meters = {c: system.CpuMeter(system.proc_pids(st, c)) for c in COMPONENTS}
        meters["clients"] = system.CpuMeter(pids)
        before = system.redis_calls(st.ports.redis)
        for m in meters.values():
            m.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            await p.stdin.drain()
        results = []
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), timeout=seconds + 120)
            results.append(orjson.loads(line))
        cpu = {c: m.stop() for c, m in meters.items()}
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), timeout=10)
            except TimeoutError:
                p.kill()
                await p.wait()
    await asyncio.sleep(0.3)  # settlements and give-backs in flight land
    calls = system.limiter_round_trips(before, system.redis_calls(st.ports.redis))
    n_ok = sum(r["ok"] for r in results)
    ok = max(1, n_ok)
    chunks = sum(r["tokens"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    out: dict[str, Any] = {
        "clients": len(procs),
        "requests": sum(r["requests"] for r in results),
        "ok": n_ok,
        "req_s": round(n_ok / elapsed, 1),
        "cpu_us_per_request": {c: round(v / ok * 1e6, 1) for c, v in cpu.items()},
        "redis_calls_per_request": round(sum(calls.values()) / ok, 3),
    }
    if shape.stream:
        out["chunks_s"] = round(chunks / elapsed, 1)
        out["cpu_us_per_chunk"] = {c: round(v / max(1, chunks) * 1e6, 2) for c, v in cpu.items()}
    return out


async def measure(b: Bench, stacks: Stacks) -> None:
    """Every (workers, allowances) variant on a stack of its own, one after another."""
    cores = os.cpu_count() or 1
    counts = worker_counts(int(os.environ.get("AIQ_BENCH_SCALE_MAX_WORKERS", cores)))
    clients = int(os.environ.get("AIQ_BENCH_CLIENTS", client_count(cores)))
    # simulator processes sharing its port: one per four cores (it is not what saturates)
    sims = int(os.environ.get("AIQ_BENCH_SIMS", max(1, cores // 4)))
    c, secs = b.plan.worker_concurrency, b.plan.worker_seconds * 2
    c = int(os.environ.get("AIQ_BENCH_SCALE_CONCURRENCY", c))
    unary = Shape(prompt_tokens=1000, max_tokens=8)
    stream = Shape(prompt_tokens=100, max_tokens=200, stream=True, itl_ms=1)
    serve = (sys.executable, "-m", "extproc", "serve")
    raw: dict[str, Any] = {"cores": cores, "workers": counts, "concurrency": c, "seconds": secs}
    raw["clients"] = clients
    raw["sims"] = sims
    b.log(
        f"scale: workers {counts}, allowances off/on, 1 and 64 tenants, c={c}, {secs}s each, "
        f"{clients} load-client process(es), {sims} simulator process(es)"
    )
    for n in counts:
        for allow in (False, True):
            name = f"{n} worker{'s' if n > 1 else ''}, allowances {'on' if allow else 'off'}"
            env = {"AIQ_ALLOWANCES": "1" if allow else "0"}  # on by default: "off" pins 0
            st = await stacks.start(
                f"scale-{n}-{int(allow)}",
                extproc_argv=(*serve, "--workers", str(n)),
                env=env,
                sims=sims,
            )
            try:
                await batch(st.base_url, KEY, unary, count=40, concurrency=4)
                res: dict[str, Any] = {}
                for label, keys in (("1 tenant", (KEY,)), ("64 tenants", SCALE_KEYS)):
                    await timed_keys(st.base_url, keys, unary, seconds=1.0, concurrency=c)
                    res[label] = {
                        "non-streaming": await run_one(
                            st, keys, unary, seconds=secs, concurrency=c, clients=clients
                        ),
                        "streamed": await run_one(
                            st, keys, stream, seconds=secs, concurrency=c, clients=clients
                        ),
                    }
                raw[name] = res
            finally:
                st.stop()
            for label, r in res.items():
                u, s = r["non-streaming"], r["streamed"]
                cpu = ", ".join(f"{k} {v:.0f}" for k, v in u["cpu_us_per_request"].items())
                b.table.add(
                    Row(
                        "10 scale",
                        f"req/s, {name}, {label}",
                        "req/s",
                        u["req_s"],
                        note=f"CPU µs/request: {cpu}; Redis calls/request "
                        f"{u['redis_calls_per_request']}",
                    )
                )
                cpu_c = ", ".join(f"{k} {v:.1f}" for k, v in s["cpu_us_per_chunk"].items())
                b.table.add(
                    Row(
                        "10 scale",
                        f"chunks/s, {name}, {label}",
                        "chunks/s",
                        s["chunks_s"],
                        note=f"CPU µs/chunk: {cpu_c}; Redis calls/stream "
                        f"{s['redis_calls_per_request']}",
                    )
                )
    b.raw["scale"] = raw


SCENARIO = Scenario("scale", measure)
