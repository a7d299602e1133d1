"""Where the gateway's fixed per-request CPU goes, by arms behind real Envoys (issue 17).

Non-streaming chat completions (the bench's admission shape: a 1k-token prompt, ``max_tokens``
8) at concurrency 4 through one Envoy per arm, each arm's processor CPU per request taken from
``/proc`` (as ``scripts/bench`` does), arms alternated over the rounds:

- ``floor``: the do-nothing processor (:mod:`extproc.bench.floor`);
- ``floor+1redis`` / ``floor+2redis``: the same with one or two awaited ``EVALSHA`` calls of a
  one-line script at the request body (what a Redis round trip inside a grpc.aio handler costs);
- ``gateway``: ``ai-quota serve`` with the bench's rules and the default settings (local
  allowances on since issue 35: its hourly limits take them);
- ``gateway-info-logs-off``: the same at log level ``warning`` (no info lines);
- ``gateway-bound``: the same with ``requests.admit_on_bound: true`` (a prompt far from its
  limits admitted on its byte bound and counted only if it must be: issue 17's lever, off by
  default since issue 33 for crash safety);
- ``gateway-allowances``: the gateway with local allowances (``AIQ_ALLOWANCES=1``, issue 27)
  and windows up to a day under them: admitted and settled without a Redis round trip while
  the tenant is far from its limits (since issue 35 the ``gateway`` arm takes them as well).

``python tests/benchmark/bench_fixed_part.py [--rounds R] [--requests N] [--out F]`` prints the
median and the per-round figures and writes them as JSON.  ``--serve-floor-redis`` is the
processor of the ``floor+Nredis`` arms (``FLOOR_REDIS_CALLS`` calls).  It lives beside the
tests because it is a measurement, not a test; ``pytest -m benchmark`` runs a short pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch
from extproc.bench.floor import FloorStream
from extproc.bench.floor import serve as floor_serve
from extproc.stack import Stack

SHAPE = Shape(prompt_tokens=1000, max_tokens=8)


class RedisFloor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The floor's answers, after ``calls`` awaited script calls at the request body."""

    def __init__(self, script: Any, calls: int) -> None:
        self.script, self.calls = script, calls

    async def Process(self, request_iterator: Any, context: Any) -> None:
        """Answer each message; Redis first at the request body."""
        stream = FloorStream()
        while True:
            req = await context.read()
            if req is grpc.aio.EOF:
                return
            if req.WhichOneof("request") == "request_body":
                for _ in range(self.calls):
                    await self.script(keys=["{floor}:n"], args=[1])
            resp = stream.answer(req)
            if resp is not None:
                await context.write(resp)


async def serve_floor_redis(address: str, redis_url: str, calls: int) -> None:
    """The ``floor+Nredis`` processor, until SIGTERM."""
    client = aioredis.Redis.from_url(redis_url)
    script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    await floor_serve(address, RedisFloor(script, calls))
    await client.aclose()


ARMS = (
    "floor",
    "floor+1redis",
    "floor+2redis",
    "gateway",
    "gateway-info-logs-off",
    "gateway-bound",
    "gateway-allowances",
)


ALLOWANCES = {"AIQ_ALLOWANCES": "1", "AIQ_ALLOWANCE_MAX_WINDOW_S": "86400"}


def start_arms(
    workdir: Path, only: tuple[str, ...] = ARMS, base_tree: Path | None = None
) -> dict[str, Stack]:
    """The stacks of the arms in ``only`` (the floor always), sharing the floor's Redis;
    with ``base_tree`` (a directory holding another revision's ``extproc`` package) also
    ``gateway@base`` and ``gateway-allowances@base``, the same processors run from that tree."""
    rules = system.bench_rules()
    here = str(Path(__file__).resolve())
    arms: dict[str, Stack] = {}
    arms["floor"] = system.start_stack(
        workdir / "floor", rules, extproc_argv=(sys.executable, "-m", "extproc.bench.floor")
    )
    url = arms["floor"].effective_redis_url
    for n in (1, 2):
        if f"floor+{n}redis" not in only:
            continue
        arms[f"floor+{n}redis"] = system.start_stack(
            workdir / f"floor{n}",
            rules,
            extproc_argv=(sys.executable, here, "--serve-floor-redis"),
            redis_url=url,
            env={"FLOOR_REDIS_CALLS": str(n)},
        )
    if "gateway" in only:
        arms["gateway"] = system.start_stack(workdir / "gw", rules, redis_url=url)
    if "gateway-info-logs-off" in only:
        arms["gateway-info-logs-off"] = system.start_stack(
            workdir / "gw-warn", rules, redis_url=url, env={"AIQ_LOG_LEVEL": "warning"}
        )
    if "gateway-bound" in only:
        bound = {**rules, "requests": {**rules.get("requests", {}), "admit_on_bound": True}}
        arms["gateway-bound"] = system.start_stack(workdir / "gw-bound", bound, redis_url=url)
    if "gateway-allowances" in only:
        arms["gateway-allowances"] = system.start_stack(
            workdir / "gw-allow",
            rules,
            redis_url=url,
            env=ALLOWANCES,
        )
    if base_tree is not None:
        base = {"PYTHONPATH": str(base_tree)}
        if "gateway" in only:
            arms["gateway@base"] = system.start_stack(
                workdir / "gw-base", rules, redis_url=url, env=base
            )
        if "gateway-allowances" in only:
            arms["gateway-allowances@base"] = system.start_stack(
                workdir / "gw-allow-base", rules, redis_url=url, env={**base, **ALLOWANCES}
            )
    return arms


async def measure(
    rounds: int, requests: int, only: tuple[str, ...] = ARMS, base_tree: Path | None = None
) -> dict[str, Any]:
    """CPU per request of every arm, per round (the arms in order; odd rounds reversed)."""
    workdir = Path(tempfile.mkdtemp(prefix="aiq-fixed-"))
    arms = await asyncio.to_thread(start_arms, workdir, only, base_tree)
    try:
        for st in arms.values():
            await batch(st.base_url, KEY, SHAPE, count=50, concurrency=4)
        per_round: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                st = arms[name]
                pids = system.proc_pids(st, "extproc")
                before = system.cpu_seconds(pids)
                rs = await batch(st.base_url, KEY, SHAPE, count=requests, concurrency=4)
                spent = system.cpu_seconds(pids) - before
                assert all(r.status == 200 for r in rs), name
                per_round[name].append(round(spent / requests * 1e6, 1))
    finally:
        for st in arms.values():
            st.stop()
    ratios = {
        name: [round(g / f, 3) for g, f in zip(v, per_round["floor"], strict=True) if f > 0]
        for name, v in per_round.items()
        if name != "floor"
    }
    return {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "requests_per_round": requests,
        "concurrency": 4,
        "shape": {"prompt_tokens": SHAPE.prompt_tokens, "max_tokens": SHAPE.max_tokens},
        "cpu_us_per_request": {
            name: {"median": statistics.median(v), "rounds": v} for name, v in per_round.items()
        },
        "ratio_to_floor_per_round": {
            name: {"median": statistics.median(v), "rounds": v} for name, v in ratios.items() if v
        },
    }


@pytest.mark.benchmark
def test_fixed_part_arms_run() -> None:
    """A short pass of every arm: each answers and spends CPU (no assertion on speed)."""
    res = asyncio.run(measure(rounds=1, requests=20))
    assert all(v["median"] > 0 for v in res["cpu_us_per_request"].values())


def main() -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--arm",
        action="append",
        choices=ARMS,
        help="measure only these arms (repeatable; the floor always runs)",
    )
    p.add_argument(
        "--base-tree",
        type=Path,
        help="a directory with another revision's extproc package: adds its gateway arms",
    )
    p.add_argument("--serve-floor-redis", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_floor_redis:
        import uvloop

        uvloop.install()
        asyncio.run(
            serve_floor_redis(
                os.environ.get("AIQ_GRPC_ADDRESS", "127.0.0.1:50051"),
                os.environ["AIQ_REDIS_URL"],
                int(os.environ.get("FLOOR_REDIS_CALLS", "1")),
            )
        )
        return 0
    only = ("floor", *(args.arm or ARMS))
    res = asyncio.run(measure(args.rounds, args.requests, only, args.base_tree))
    for name, v in res["cpu_us_per_request"].items():
        print(f"{name:24s} {v['median']:8.1f} us/request  rounds {v['rounds']}")
    for name, v in res["ratio_to_floor_per_round"].items():
        print(f"{name:24s} {v['median']:8.2f} x floor     rounds {v['rounds']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
