"""Micro-benchmark of admission over levels (docs/semantics.md, "Levels"): the processor's
admission work for a request counted at 4 levels (organisation, team, tenant, end user, with
the team's cap on distinct end users) against 1 (a tenant outside any organisation), each
arm the same request shape: its buckets planned from compiled rules (``windowed``), its
charges made, ``admit.lua`` run against a real ``redis-server`` it starts, and the request
settled (a refund on every per-token counter).

Figures per request, arms alternated over ``--rounds`` (median, min and max of the rounds):
the CPU of this process (planning, packing, the client side of the calls), the Redis server's
CPU (``INFO cpu``; the scripts' work grows with the buckets), and the limiter calls.  Arms
``... allowances`` run the same through :class:`extproc.limiter.allowance.AllowanceLimiter`:
a request whose buckets can all be drawn from local allowances makes no call; a team's set of
distinct end users cannot be (a set, not a counter), so a request of such a team makes one.

``python -m extproc.bench.levels_micro [--requests N] [--concurrency C] [--rounds R] [--out F]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from extproc.bench.limiter_micro import _start_redis
from extproc.config.load import load_config_text
from extproc.config.runtime import Tenant
from extproc.core.admission_plan import admission_charges, compute_cost
from extproc.core.keys import ledger_key, windowed
from extproc.core.rules import Adjustment, Charging
from extproc.limiter.allowance import AllowanceLimiter
from extproc.limiter.redis import RedisLimiter

TTL = 60_000
BIG = 10**12


def rules(prefix: str) -> dict[str, Any]:
    """Rules with a tenant alone (1 level) and a tenant whose key is in a team of an
    organisation with per-end-user limits (4 levels); limits far out of reach."""
    lim = [{"per": "minute", "rpm": BIG, "tpm": BIG}]
    return {
        "version": 1,
        "models": {"m": {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 4096}},
        "plans": {"p": {"limits": lim}},
        "organisations": {f"{prefix}o": {"limits": [{"per": "minute", "tpm": BIG}]}},
        "teams": {
            f"{prefix}t": {
                "organisation": f"{prefix}o",
                "limits": [{"per": "minute", "tpm": BIG}],
                "end_users": {"limits": [{"per": "minute", "tpm": BIG}], "max_users": 100},
            },
            f"{prefix}n": {  # no end-user limits: 3 levels every allowance can serve
                "organisation": f"{prefix}o",
                "limits": [{"per": "minute", "tpm": BIG}],
            },
        },
        "tenants": {
            f"{prefix}one": {"plan": "p", "keys": [{"name": "k", "plaintext": f"sk-{prefix}1"}]},
            f"{prefix}four": {
                "plan": "p",
                "keys": [
                    {"name": "k", "plaintext": f"sk-{prefix}4", "team": f"{prefix}t"},
                    {"name": "n", "plaintext": f"sk-{prefix}3", "team": f"{prefix}n"},
                ],
            },
        },
    }


class Arm:
    """One kind of request (its tenant and key) on one limiter."""

    def __init__(self, name: str, lim: Any, tenant: Tenant, key: str, user: str) -> None:
        self.name, self.lim, self.tenant, self.key, self.user = name, lim, tenant, key, user
        self.limits = tenant.limits_for(key)
        self.cost = compute_cost(
            input_tokens=1000, per_choice_max=8, n=1, stream=False, charging=Charging()
        )

    async def request(self) -> None:
        now = int(time.time() * 1000)
        t = self.tenant
        bs = windowed("aiq", t.slot, self.key, self.limits, now, user=self.user)
        led = ledger_key("aiq", t.slot, uuid.uuid4().hex)
        res = await self.lim.admit(
            led,
            admission_charges(bs, self.cost),
            tpm_charged=self.cost.tpm_amount,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=now,
            lease_until_ms=now + 30_000,
        )
        if not res.admitted:
            raise RuntimeError(f"{self.name}: refused")
        back = [Adjustment(b.key, -3, b.expire_at_ms) for b in bs if b.kind == "tpm"]
        await self.lim.settle(led, back, ledger_ttl_ms=TTL)

    async def run(self, n: int, concurrency: int, server: redis.Redis) -> tuple[float, ...]:
        """(CPU µs of this process, Redis server CPU µs, limiter calls) per request."""
        left = n
        calls0 = _calls(self.lim)
        srv0 = _server_cpu(server)
        cpu0 = time.process_time()

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await self.request()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu = time.process_time() - cpu0
        srv = _server_cpu(server) - srv0
        return 1e6 * cpu / n, 1e6 * srv / n, (_calls(self.lim) - calls0) / n


def _calls(lim: Any) -> int:
    inner = getattr(lim, "inner", lim)
    return int(inner.round_trips)


def _server_cpu(server: redis.Redis) -> float:
    info: dict[str, Any] = server.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


async def run(requests: int, concurrency: int, rounds: int) -> dict[str, Any]:
    """Start Redis, run the arms interleaved, return the results."""
    prefix = f"b{uuid.uuid4().hex[:6]}"
    cfg = load_config_text(yaml.safe_dump(rules(prefix)))
    one, four = cfg.tenants[f"{prefix}one"], cfg.tenants[f"{prefix}four"]
    with tempfile.TemporaryDirectory(prefix="aiq-levels-micro-") as tmp:
        proc, port = _start_redis(Path(tmp))
        url = f"redis://127.0.0.1:{port}/0"
        server = redis.Redis(port=port)
        plain = RedisLimiter.from_url(url, timeout_ms=2000)
        allowed = AllowanceLimiter(RedisLimiter.from_url(url, timeout_ms=2000))
        try:
            arms = [
                Arm("1 level", plain, one, "k", ""),
                Arm("4 levels", plain, four, "k", "user-1"),
                Arm("1 level, allowances", allowed, one, "k", ""),
                Arm("3 levels (no end users), allowances", allowed, four, "n", ""),
                Arm("4 levels, allowances", allowed, four, "k", "user-1"),
            ]
            for arm in arms:  # warm-up: connections, script cache, allowances
                await arm.run(300, concurrency, server)
            figs: dict[str, list[tuple[float, ...]]] = {a.name: [] for a in arms}
            for _ in range(rounds):
                for arm in arms:
                    figs[arm.name].append(await arm.run(requests, concurrency, server))
        finally:
            await allowed.close()
            await plain.close()
            server.close()
            proc.terminate()
            proc.wait(10)
    out: dict[str, Any] = {}
    for name, rs in figs.items():
        out[name] = {
            "cpu_us_per_request": _stats([r[0] for r in rs]),
            "redis_cpu_us_per_request": _stats([r[1] for r in rs]),
            "calls_per_request": _stats([r[2] for r in rs]),
        }
    base = out["1 level"]["cpu_us_per_request"]["median"]
    four_cpu = out["4 levels"]["cpu_us_per_request"]["median"]
    return {
        "kind": "levels-micro",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg": os.getloadavg(),
        },
        "params": {"requests_per_round": requests, "concurrency": concurrency, "rounds": rounds},
        "arms": out,
        "cpu_4_levels_over_1": round(four_cpu / base, 3) if base else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m extproc.bench.levels_micro``."""
    p = argparse.ArgumentParser(prog="python -m extproc.bench.levels_micro", description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="requests per arm and round")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent request loops")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    result = asyncio.run(run(args.requests, args.concurrency, args.rounds))
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
