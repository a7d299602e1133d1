"""Micro-benchmark of the Redis limiter alone: CPU of this process per request and Redis calls
per request, for admission + settlement shaped like the bench's non-streaming request (an RPM
and a TPM bucket, a lease, a record draft), against a real ``redis-server`` it starts.

Arms, run alternately (A B A B ...) for ``--rounds`` rounds; the JSON has the median and the
range of the per-round figures:

- ``per-request settle``: ``admit`` then ``settle`` awaited by each request (today's path);
- ``batched settle``: ``admit`` awaited, the settlement handed to a
  :class:`extproc.limiter.batch.SettlementBatcher` (its calls counted, its CPU included: the
  run ends when every settlement was taken);
- ``redis-py packing``: the first arm with redis-py's pure-Python command packer instead of
  hiredis's (what :func:`extproc.limiter.packing.use_hiredis_packing` replaced);
- ``allowances``: the batched arm behind :class:`extproc.limiter.allowance.AllowanceLimiter`
  (a tenant far from its limits: admitted and settled from local allowances; the takes and
  give-backs counted, a fresh tenant each round, so its warm-up is included).

``python -m extproc.bench.limiter_micro [--requests N] [--concurrency C] [--rounds R] [--out F]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis
from redis.asyncio.connection import Connection

from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.allowance import AllowanceLimiter
from extproc.limiter.base import AdmitCall, SettleCall
from extproc.limiter.batch import BatchSettings, SettlementBatcher
from extproc.limiter.redis import RedisLimiter
from extproc.stack import free_port

TTL = 60_000
DRAFT = '{"request_id":"' + "r" * 32 + '","tenant":"t-bench","model":"sim-small"}'


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(  # noqa: S603
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise
            time.sleep(0.05)
    client.close()
    return proc, port


class Arm:
    """One way of admitting and settling a request."""

    def __init__(
        self, name: str, lim: RedisLimiter | AllowanceLimiter, batcher: SettlementBatcher | None
    ) -> None:
        self.name = name
        self.lim = lim
        self.batcher = batcher

    async def request(self, tag: str, expire_at: int) -> None:
        led = f"{tag}:req:{uuid.uuid4().hex}"
        now = int(time.time() * 1000)
        res = await self.lim.admit(
            AdmitCall(
                led,
                [
                    BucketCharge(f"{tag}:rpm:t:*:60:1", "rpm", 1, 10**12, expire_at),
                    BucketCharge(
                        f"{tag}:tpm:t:*:60:1", "tpm", 1000, 10**15, expire_at, refundable=1000
                    ),
                ],
                tpm_charged=1000,
                count_refused=False,
                ledger_ttl_ms=TTL,
                now_ms=now,
                lease_until_ms=now + 30_000,
                record_draft=DRAFT,
            )
        )
        if not res.admitted:
            raise RuntimeError("the bench tenant was refused")
        adjustments = [Adjustment(f"{tag}:tpm:t:*:60:1", -200, expire_at)]
        if self.batcher is None:
            await self.lim.settle(led, adjustments, ledger_ttl_ms=TTL)
        else:
            self.batcher.submit(SettleCall(led, adjustments, TTL))

    async def run(self, n: int, concurrency: int) -> tuple[float, float]:
        """CPU µs of this process per request, Redis calls per request."""
        tag = f"lm:{{{uuid.uuid4().hex[:8]}}}"
        expire_at = int(time.time() * 1000) + 3_600_000
        left = n
        calls0 = self.lim.round_trips
        cpu0 = time.process_time()

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await self.request(tag, expire_at)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if self.batcher is not None and not await self.batcher.wait_idle(30.0):
            raise RuntimeError("settlements were not taken within 30 s")
        cpu = time.process_time() - cpu0
        return 1e6 * cpu / n, (self.lim.round_trips - calls0) / n


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


async def run(requests: int, concurrency: int, rounds: int, tick_s: float) -> dict[str, Any]:
    """Start Redis, run the arms interleaved, return the results."""
    with tempfile.TemporaryDirectory(prefix="aiq-limiter-micro-") as tmp:
        proc, port = _start_redis(Path(tmp))
        limiters: list[RedisLimiter] = []
        allowed: AllowanceLimiter | None = None
        try:
            url = f"redis://127.0.0.1:{port}/0"

            def limiter() -> RedisLimiter:
                lim = RedisLimiter.from_url(url, timeout_ms=2000)
                limiters.append(lim)
                return lim

            pure = limiter()
            pure.caller.client.connection_pool.connection_class = Connection
            batched = limiter()
            allowed = AllowanceLimiter(RedisLimiter.from_url(url, timeout_ms=2000))
            arms = [
                Arm("per-request settle", limiter(), None),
                Arm(
                    "batched settle",
                    batched,
                    SettlementBatcher(batched, BatchSettings(tick_s=tick_s)),
                ),
                Arm("redis-py packing", pure, None),
                Arm(
                    "allowances",
                    allowed,
                    SettlementBatcher(allowed, BatchSettings(tick_s=tick_s)),
                ),
            ]
            for arm in arms:  # warm-up: connections, script cache
                await arm.run(200, concurrency)
            cpu: dict[str, list[float]] = {a.name: [] for a in arms}
            calls: dict[str, list[float]] = {a.name: [] for a in arms}
            for _ in range(rounds):
                for arm in arms:
                    c, k = await arm.run(requests, concurrency)
                    cpu[arm.name].append(c)
                    calls[arm.name].append(k)
            for arm in arms:
                if arm.batcher is not None:
                    await arm.batcher.close(5.0)
        finally:
            if allowed is not None:
                await allowed.close()  # gives back what it holds, closes its limiter
            for lim in limiters:
                await lim.close()
            proc.terminate()
            proc.wait(10)
    return {
        "kind": "limiter-micro",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg": os.getloadavg(),
        },
        "params": {
            "requests_per_round": requests,
            "concurrency": concurrency,
            "rounds": rounds,
            "tick_s": tick_s,
        },
        "cpu_us_per_request": {k: _stats(v) for k, v in cpu.items()},
        "redis_calls_per_request": {k: _stats(v) for k, v in calls.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m extproc.bench.limiter_micro``."""
    p = argparse.ArgumentParser(prog="python -m extproc.bench.limiter_micro", description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="requests per arm and round")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent request loops")
    p.add_argument("--rounds", type=int, default=7, help="A/B rounds")
    p.add_argument("--tick-ms", type=float, default=2.0, help="the batcher's tick")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.tick_ms < 0:
        p.error("--tick-ms must be >= 0")
    result = asyncio.run(run(args.requests, args.concurrency, args.rounds, args.tick_ms / 1000))
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
