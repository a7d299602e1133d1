"""What ``WAIT 1 <ms>`` after every write would cost (issue 32 item 3): a master and one
replica on loopback (real redis-servers); the same stream charge script call (charge.lua, one
TPM bucket, a fresh sequence number each time) sent with and without ``WAIT 1 <ms>`` pipelined
behind it on the same connection (WAIT only covers the connection's own writes), in
alternated rounds so both arms see the same machine.  Two figures per arm: the latency of one
call sent alone (p50, p99) and the calls per second of ``concurrency`` callers at once.

``python -m extproc.bench.wait_cost`` prints the figures as JSON.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from extproc.bench.redis_ha import SentinelGroup
from extproc.limiter.scripts import load_script


async def _arm(
    client: Redis, script: Any, wait_ms: int, *, n: int, concurrency: int, tag: str
) -> dict[str, float]:
    far = int(time.time() * 1000) + 600_000
    seq = 0

    async def one(ledger: str) -> float:
        nonlocal seq
        seq += 1
        keys = [ledger, f"{tag}:tpm"]
        args = [1, seq, 16, "0", 60_000, 1, 0, 10**12, far, 1_000_000, 0, 0, 0]
        t0 = time.perf_counter()
        async with client.pipeline(transaction=False) as pipe:
            await script(keys=keys, args=args, client=pipe)
            if wait_ms:
                pipe.execute_command("WAIT", 1, wait_ms)
            res = await pipe.execute()
        if wait_ms and int(res[-1]) < 1:
            raise RuntimeError("WAIT: no replica acknowledged in time")
        return time.perf_counter() - t0

    alone = [await one(f"{tag}:req:alone") for _ in range(n)]

    async def caller(i: int, per: int) -> None:
        for _ in range(per):
            await one(f"{tag}:req:c{i}")

    per = max(1, n // concurrency)
    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i, per) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    qs = statistics.quantiles(alone, n=100, method="inclusive")
    return {
        "p50_ms": statistics.median(alone) * 1000,
        "p99_ms": qs[98] * 1000,
        "calls_per_s": per * concurrency / elapsed,
    }


async def measure(
    port: int, *, rounds: int = 6, n: int = 400, concurrency: int = 16, wait_ms: int = 100
) -> dict[str, Any]:
    """Alternated rounds of both arms on the master at ``port``; medians over rounds."""
    client = Redis(port=port)
    script = client.register_script(load_script("charge"))
    arms: dict[str, list[dict[str, float]]] = {"plain": [], f"wait_1_{wait_ms}": []}
    try:
        for r in range(rounds):
            order = [0, wait_ms] if r % 2 == 0 else [wait_ms, 0]
            for w in order:
                name = f"wait_1_{wait_ms}" if w else "plain"
                arms[name].append(
                    await _arm(
                        client, script, w, n=n, concurrency=concurrency, tag=f"{{wc-{r}-{w}}}"
                    )
                )
    finally:
        await client.aclose()
    out: dict[str, Any] = {"rounds": rounds, "calls_per_round": n, "concurrency": concurrency}
    for name, runs in arms.items():
        out[name] = {k: round(statistics.median(x[k] for x in runs), 3) for k in runs[0]}
    plain, waited = out["plain"], out[f"wait_1_{wait_ms}"]
    out["added_p50_ms"] = round(waited["p50_ms"] - plain["p50_ms"], 3)
    out["added_p99_ms"] = round(waited["p99_ms"] - plain["p99_ms"], 3)
    out["throughput_ratio"] = round(waited["calls_per_s"] / plain["calls_per_s"], 3)
    return out


def run(workdir: Path, **kw: Any) -> dict[str, Any]:
    """A master and one replica (no sentinels needed for WAIT), then :func:`measure`."""
    group = SentinelGroup(workdir, replicas=1, down_after_ms=5000)
    try:
        return asyncio.run(measure(group.master_port(), **kw))
    finally:
        group.stop()


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(run(Path(d)), indent=2))


if __name__ == "__main__":
    main()
