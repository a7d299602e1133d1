"""The ``soak`` bench section: steady mixed traffic for a while (a minute; ten with ``--long``),
sampling what grows when something leaks: the processors' resident memory, Redis's key count
and errors, then the tenant's counter against ground truth (the simulator's records and the
gateway's own prompt counts).

Judged: memory slope (MB per minute, after a warm-up fifth), failed requests (0), counter
minus truth (0 tokens: every request settled exactly), Redis keys per finished request (each
ledger lives ``ledger_ttl_seconds``; nothing else should accumulate).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from extproc import stats
from extproc.bench import system
from extproc.bench.client import Shape, connector, send
from extproc.stack import Stack

KEY = "sk-soak"
TENANT = "t-soak"
CLIENTS = 8


async def soak(stack: Stack, seconds: float, rid: Any) -> dict[str, Any]:
    """Run the load, sample, and compare the counter with ground truth."""
    import redis.asyncio as aioredis

    from extproc.config import load_config
    from extproc.core.apis.openai.counting import count_chat_request

    cfg = load_config(stack.config)
    model = cfg.models["sim-small"]
    rds = aioredis.Redis(port=stack.ports.redis)
    pids = [p.popen.pid for p in stack.procs if p.name.startswith("extproc")]
    stop = time.monotonic() + seconds
    prompts: dict[str, int] = {}
    outcomes: list[tuple[str, int]] = []
    samples: list[dict[str, float]] = []
    t0 = time.monotonic()

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            shape = Shape(
                prompt_tokens=50 + 37 * (n % 7),
                max_tokens=20 + 13 * (n % 11),
                stream=(i + n) % 2 == 0,
            )
            body = shape.body(i * 100_000 + n)
            cid = rid("soak")
            prompts[cid] = count_chat_request(orjson.loads(body), model.counter, model.tokenizer)
            r = await send(session, stack.base_url, KEY, shape, body=body, client_request_id=cid)
            outcomes.append((cid, r.status))

    async def sampler() -> None:
        while time.monotonic() < stop:
            samples.append(
                {
                    "t": time.monotonic() - t0,
                    "rss_mb": sum(system.rss_mb(p) for p in pids),
                    "keys": float(await rds.dbsize()),
                    "done": float(len(outcomes)),
                }
            )
            await asyncio.sleep(min(2.0, max(0.5, seconds / 60)))

    async with aiohttp.ClientSession(connector=connector(CLIENTS * 2)) as session:
        await asyncio.gather(sampler(), *(client(session, i) for i in range(CLIENTS)))
    # settle: every ledger of the tenant settled, then read the counter
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        states = [
            await rds.hget(k, "state") async for k in rds.scan_iter(f"aiq:{{{TENANT}}}:req:*")
        ]
        if all(s == b"settled" for s in states):
            break
        await asyncio.sleep(0.1)
    counter = 0
    async for k in rds.scan_iter(f"aiq:{{{TENANT}}}:tpm:*"):
        counter += int(await rds.get(k) or 0)
    await rds.aclose()
    recs = {
        r.client_request_id: r
        # a ten-minute soak has some 200,000 records: give the transfer time
        for r in await asyncio.to_thread(system.sim_records, stack.sim_url, 300.0)
        if r.client_request_id in prompts
    }
    ok = [cid for cid, status in outcomes if status == 200]
    # every soak request completes, so the gateway bills the upstream's own prompt figure (the
    # simulator's, which leaves out the role tokens the gateway counts) within its bounds
    truth = sum(
        (recs[c].prompt_tokens or prompts[c]) + recs[c].tokens_sent for c in ok if c in recs
    )
    warm = [s for s in samples if s["t"] >= seconds / 5]
    errors: dict[str, int] = {}
    for p in stack.procs:
        if p.name.startswith("extproc") and p.log_path and p.log_path.exists():
            for line in p.log_path.read_text(errors="replace").splitlines():
                if '"level":"error"' in line:
                    ev = orjson.loads(line).get("event", "?") if line.startswith("{") else "?"
                    errors[ev] = errors.get(ev, 0) + 1
    return {
        "error_log_lines": errors,
        "seconds": seconds,
        "requests": len(outcomes),
        "failed": sum(1 for _, s in outcomes if s != 200),
        "missing_records": sum(1 for c in ok if c not in recs),
        "counter": counter,
        "truth": truth,
        "rss_start_mb": warm[0]["rss_mb"] if warm else 0.0,
        "rss_end_mb": samples[-1]["rss_mb"] if samples else 0.0,
        "rss_slope_mb_per_min": stats.slope_per_minute([(s["t"], s["rss_mb"]) for s in warm]),
        "keys_end": samples[-1]["keys"] if samples else 0.0,
        "samples": samples,
    }


async def bench_section(bench: Any, stack: Stack, seconds: float) -> None:
    """Add the soak rows to ``bench`` (an ``extproc.bench.plan.Bench``)."""
    from extproc.bench.report import Row, Target

    bench.log(f"soak: {CLIENTS} clients, mixed streams and non-streams, {seconds:.0f} s")
    res = await soak(stack, seconds, bench.rid)
    bench.raw["soak"] = res
    n = max(1, res["requests"])
    section = "9 soak"
    bench.table.add(
        Row(
            section,
            f"processor memory slope after warm-up ({res['seconds']:.0f} s)",
            "MB/min",
            res["rss_slope_mb_per_min"],
            # a slope over less than a minute is mostly warm-up (caches, pools): not judged
            goal=Target("value", "<=", 2.0, "MB/min") if seconds >= 60 else None,
            note=f"{res['rss_start_mb']:.1f} -> {res['rss_end_mb']:.1f} MB",
        )
    )
    bench.table.add(
        Row(
            section,
            "failed requests",
            "requests",
            float(res["failed"]),
            goal=Target("value", "<=", 0, "requests"),
            note=f"of {res['requests']}",
        )
    )
    diff = res["counter"] - res["truth"]
    bench.table.add(
        Row(
            section,
            "|TPM counter - ground truth| after settlement",
            "tokens",
            float(abs(diff)),
            goal=Target("value", "<=", 0, "tokens"),
            note=f"counter {res['counter']}, truth {res['truth']} ({diff:+d}), "
            f"records missing {res['missing_records']}",
        )
    )
    errs = res["error_log_lines"]
    bench.table.add(
        Row(
            section,
            "error log lines of the processor",
            "lines",
            float(sum(errs.values())),
            goal=Target("value", "<=", 0, "lines"),
            note=", ".join(f"{k} x{v}" for k, v in errs.items()) or "none",
        )
    )
    bench.table.add(
        Row(
            section,
            "Redis keys per finished request",
            "keys",
            res["keys_end"] / n,
            note="a ledger and a usage-record marker per request, expiring with "
            "ledger_ttl_seconds and the marker TTL; nothing else grows",
        )
    )
