"""Micro-benchmark of the processor's CPU per non-streaming request, in one process (issue 27).

The request path of ``bench_fixed_part.py``'s ``gateway-allowances`` arm without gRPC and
Envoy: :class:`extproc.server.servicer.ExternalProcessorServicer` runs on
``bench_chunk.FakeContext`` (real ``ProcessingRequest`` protobufs in, every reply serialized,
one event-loop turn per read), with the gateway as ``ai-quota serve`` builds it with
``AIQ_ALLOWANCES=1``: :class:`extproc.limiter.allowance.AllowanceLimiter` around the real
:class:`extproc.limiter.redis.RedisLimiter` against a ``redis-server`` this module starts, the
usage-record writer, metrics and JSON info logging (stderr to ``/dev/null``: the rendering is
paid, the terminal is not).  Arms:

- ``gateway``: as above, ``--no-allowances`` drops the allowance layer;
- ``floor``: the do-nothing processor (:mod:`extproc.bench.floor`), same messages.

Each request is the bench's admission shape (a 1k-token prompt, ``max_tokens`` 8): request
headers, the JSON body, 200 response headers, the JSON response with its ``usage``.  CPU is
``time.process_time`` over a batch and the settlements it left (bounded wait); arms alternate
per round; the JSON has the median and range.  ``--profile FILE`` writes a cProfile of one
more gateway batch and prints its top functions (own and cumulative time).

``python tests/benchmark/bench_request.py [--requests N] [--rounds R] [--profile F] [--out F]``;
``pytest -m benchmark tests/benchmark/bench_request.py`` runs a quick pass.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: ``tests``

from extproc.bench.client import Shape
from extproc.bench.drivers import KEY
from extproc.bench.floor import FloorServicer
from extproc.bench.limiter_micro import _start_redis
from extproc.bench.system import bench_rules
from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import Limiter
from extproc.limiter.redis import RedisLimiter
from extproc.logs import configure_logging
from extproc.metrics import Metrics
from extproc.records.writer import UsageRecorder
from extproc.server.servicer import ExternalProcessorServicer
from tests.benchmark.bench_chunk import FakeContext, Process, _headers, _settled, run_streams

SHAPE = Shape(prompt_tokens=1000, max_tokens=8)


def request_messages(serial: int) -> list[Any]:
    """The ProcessingRequests Envoy sends for one non-streaming chat completion."""
    rid = f"req-micro-{serial}"
    answer = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": 1_764_800_000,
        "model": "sim-small",
        "system_fingerprint": "ai-quota-sim",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "one two three four five six seven"},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 1004, "completion_tokens": 8, "total_tokens": 1012},
    }
    head = {
        ":path": "/v1/chat/completions",
        ":method": "POST",
        ":authority": "127.0.0.1",
        ":scheme": "http",
        "x-request-id": rid,
        "user-agent": "bench",
        **SHAPE.headers(KEY),
    }
    return [
        pb.ProcessingRequest(request_headers=_headers(head)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=SHAPE.body(serial), end_of_stream=True)),
        pb.ProcessingRequest(
            response_headers=_headers(
                {":status": "200", "content-type": "application/json", "content-length": "400"}
            )
        ),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(body=orjson.dumps(answer), end_of_stream=True)
        ),
    ]


async def batch_cpu(
    process: Process,
    gw: Gateway | None,
    count: int,
    concurrency: int,
    serial: list[int],
    profiler: cProfile.Profile | None = None,
) -> float:
    """CPU µs per request of a batch of ``count`` requests (settlements included)."""
    reqs = []
    for _ in range(count):
        serial[0] += 1
        reqs.append(request_messages(serial[0]))
    cpu0 = time.process_time()
    if profiler is not None:
        profiler.enable()
    ctxs: list[FakeContext] = await run_streams(process, reqs, concurrency)
    if gw is not None:
        await _settled(gw)
    if profiler is not None:
        profiler.disable()
    cpu = time.process_time() - cpu0
    if any(c.written != 4 for c in ctxs):
        raise RuntimeError("a request did not get its four replies")
    return 1e6 * cpu / count


def open_gateway(
    url: str, *, allowances: bool
) -> tuple[Gateway, Limiter, RedisLimiter, UsageRecorder]:
    """The gateway as ``ai-quota serve`` builds it on the Redis at ``url`` (with allowances as
    ``AIQ_ALLOWANCES=1`` and the bench's window cap); also its limiter, the Redis limiter
    under it and the usage-record writer, for closing."""
    cfg = load_config_text(orjson.dumps(bench_rules()).decode())
    clock, metrics = SystemClock(), Metrics()
    redis_lim = RedisLimiter.from_url(
        url,
        timeout_ms=cfg.redis_timeout_ms,
        cooldown_ms=cfg.breaker_cooldown_ms,
        clock=clock,
        metrics=metrics,
    )
    lim: Limiter = redis_lim
    if allowances:
        lim = AllowanceLimiter(
            redis_lim,
            AllowanceSettings(max_window_s=86_400, lease_ms=cfg.reservation_lease_ms),
            clock=clock,
            metrics=metrics,
        )
    recorder = UsageRecorder.from_url(url, "aiq:usage", maxlen=1_000_000, metrics=metrics)
    gw = Gateway(config=cfg, limiter=lim, clock=clock, metrics=metrics, recorder=recorder)
    gw.install(cfg, "micro")
    return gw, lim, redis_lim, recorder


async def run(
    requests: int,
    concurrency: int,
    rounds: int,
    profile: str | None,
    *,
    allowances: bool = True,
    top: int = 45,
) -> dict[str, Any]:
    """Start Redis, run the arms alternately, return the results."""
    with tempfile.TemporaryDirectory(prefix="aiq-req-micro-") as tmp:
        proc, port = _start_redis(Path(tmp))
        url = f"redis://127.0.0.1:{port}/0"
        gw, lim, redis_lim, recorder = open_gateway(url, allowances=allowances)
        real = ExternalProcessorServicer(gw)
        arms: dict[str, tuple[Process, Gateway | None]] = {
            "gateway": (real.Process, gw),
            "floor": (FloorServicer().Process, None),
        }
        trips0 = 0
        try:
            serial = [0]
            for _, (process, g) in arms.items():  # warm-up: connections, scripts, allowances
                await batch_cpu(process, g, 200, concurrency, serial)
            gc.collect()
            gc.freeze()
            trips0 = redis_lim.round_trips
            results: dict[str, list[float]] = {a: [] for a in arms}
            for r in range(rounds):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for name in order:
                    process, g = arms[name]
                    results[name].append(
                        round(await batch_cpu(process, g, requests, concurrency, serial), 1)
                    )
            trips = (redis_lim.round_trips - trips0) / (rounds * requests)
            prof_text = None
            if profile:
                profiler = cProfile.Profile()
                await batch_cpu(real.Process, gw, requests, concurrency, serial, profiler)
                profiler.dump_stats(profile)
                buf = io.StringIO()
                st = pstats.Stats(profiler, stream=buf)
                st.sort_stats("tottime").print_stats(top)
                st.sort_stats("cumulative").print_stats(top)
                prof_text = buf.getvalue()
            await gw.background.drain_settlements(5.0)
        finally:
            await lim.close()
            await recorder.close()
            proc.terminate()
            proc.wait(10)
    ratios = [g / f for g, f in zip(results["gateway"], results["floor"], strict=True) if f > 0]
    return {
        "kind": "request-micro",
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
            "allowances": allowances,
        },
        "cpu_us_per_request": {
            arm: {"median": statistics.median(v), "rounds": v} for arm, v in results.items()
        },
        "ratio": {
            "median": round(statistics.median(ratios), 2),
            "min": round(min(ratios), 2),
            "max": round(max(ratios), 2),
        },
        "redis_round_trips_per_request": round(trips, 3),
        "profile_top": prof_text,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python tests/benchmark/bench_request.py``."""
    p = argparse.ArgumentParser(prog="python tests/benchmark/bench_request.py")
    p.add_argument("--requests", type=int, default=1000, help="requests per arm and round")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-allowances", action="store_true", help="the gateway without allowances")
    p.add_argument("--profile", help="write a cProfile of one more gateway batch here")
    p.add_argument("--top", type=int, default=45, help="functions listed from the profile")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    # as ``ai-quota serve`` runs: JSON info lines (rendered; written to /dev/null)
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(devnull, 2)
    try:
        configure_logging("json", "info")
        if os.environ.get("AIQ_EVENT_LOOP", "uvloop") != "asyncio":
            import uvloop

            uvloop.install()
        result = asyncio.run(
            run(
                args.requests,
                args.concurrency,
                args.rounds,
                args.profile,
                allowances=not args.no_allowances,
                top=args.top,
            )
        )
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
    prof = result.pop("profile_top", None)
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if prof:
        print(prof)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


@pytest.mark.benchmark
async def test_quick_pass_measures_both_arms() -> None:
    """One short round: every request answered four times, a CPU figure for each arm."""
    result = await run(requests=20, concurrency=2, rounds=1, profile=None)
    assert all(v["median"] > 0 for v in result["cpu_us_per_request"].values())


if __name__ == "__main__":
    sys.exit(main())
