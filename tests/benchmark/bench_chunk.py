"""Micro-benchmark of the per-chunk CPU of the stream path, in one process, against the floor.

Both arms run their servicer's ``Process`` on a fake gRPC context that hands over real
``ProcessingRequest`` protobufs and serializes every reply with ``SerializeToString()`` (what
grpc.aio does with it), yielding to the event loop once per message as a gRPC read does:

- ``gateway``: :class:`extproc.server.servicer.ExternalProcessorServicer` with the real
  :class:`extproc.limiter.redis.RedisLimiter` against a ``redis-server`` this module starts,
  the bench's rules (:func:`extproc.bench.system.bench_rules`: lazy, one charge every N = 64
  tokens), metrics and logging as ``ai-quota serve`` sets them up;
- ``floor``: the do-nothing processor of :mod:`extproc.bench.floor`, same loop, same messages.

Each request is a chat completion streamed the simulator's way (one ``chat.completion.chunk``
event per body chunk, one cl100k token each, then the usage event and ``[DONE]``).  CPU per
chunk (``time.process_time``) is the slope between streams of 50 and 500 chunks, as in
``scripts/bench``; arms and lengths alternate within every round; the JSON has the median and
range over rounds.  ``--profile FILE`` also writes a cProfile of the gateway arm (500-chunk
streams) and prints its top functions.

``python tests/benchmark/bench_chunk.py [--streams N] [--rounds R] [--every N] [--profile F]
[--handle-only] [--out F]``; ``pytest -m benchmark tests/benchmark/bench_chunk.py`` runs one
quick pass of each mode (no assertion on speed).  It lives beside the tests, not in
``extproc.bench``, because it drives the server's classes in-process (the bench tool never
imports the server: ``tests/unit/test_layering.py``).
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.bench.floor import FloorServicer, FloorStream
from extproc.bench.limiter_micro import _start_redis
from extproc.bench.system import bench_rules
from extproc.clock import SystemClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.limiter.redis import RedisLimiter
from extproc.logs import configure_logging
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from extproc.server.servicer import ExternalProcessorServicer
from extproc.sim.text import generate_pieces

LENGTHS = (50, 500)
KEY = "sk-bench"


def _headers(pairs: dict[str, str], *, eos: bool = False) -> Any:
    hh = pb.HttpHeaders(end_of_stream=eos)
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_messages(chunks: int, serial: int) -> list[Any]:
    """The ProcessingRequests Envoy sends for one streamed chat completion of ``chunks``
    one-token deltas (full duplex: one response body message per upstream chunk)."""
    rid = f"micro-{serial}"
    body = orjson.dumps(
        {
            "model": "sim-small",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": chunks,
            "messages": [{"role": "user", "content": "hello " * 100}],
        }
    )
    msgs = [
        pb.ProcessingRequest(
            request_headers=_headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    ":authority": "localhost",
                    "content-type": "application/json",
                    "authorization": f"Bearer {KEY}",
                    "x-request-id": rid,
                }
            )
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(
            response_headers=_headers({":status": "200", "content-type": "text/event-stream"})
        ),
    ]
    base = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": 1_764_800_000,
        "model": "sim-small",
        "system_fingerprint": "ai-quota-sim",
    }

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _event({**base, "choices": [choice], "usage": None})

    events = [chunk({"role": "assistant", "content": ""}, None)]
    events += [chunk({"content": w}, None) for w in generate_pieces("english", serial, 0, chunks)]
    events.append(chunk({}, "length"))
    usage = {"prompt_tokens": 100, "completion_tokens": chunks, "total_tokens": 100 + chunks}
    events.append(_event({**base, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    for i, ev in enumerate(events):
        end = i == len(events) - 1
        msgs.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=ev, end_of_stream=end)))
    msgs.append(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    return msgs


class FakeContext:
    """The part of ``grpc.aio.ServicerContext`` the servicers use: ``read`` yields to the loop
    once and hands over the next message (EOF at the end), ``write`` serializes the reply."""

    def __init__(self, messages: list[Any]) -> None:
        self._it = iter(messages)
        self.written = 0
        self.bytes = 0

    async def read(self) -> Any:
        """The next message, after one event-loop turn (a gRPC read resolves a future)."""
        await asyncio.sleep(0)
        return next(self._it, grpc.aio.EOF)

    async def write(self, resp: Any) -> None:
        """Serialize the reply as grpc.aio does."""
        self.bytes += len(resp.SerializeToString())
        self.written += 1

    def cancelled(self) -> bool:
        """Never cancelled."""
        return False

    def done(self) -> bool:
        """Never done early."""
        return False


Process = Callable[[Any, Any], Awaitable[None]]


async def run_streams(
    process: Process, streams: list[list[Any]], concurrency: int
) -> list[FakeContext]:
    """Run the pre-built ``streams``, ``concurrency`` at a time."""
    contexts = [FakeContext(msgs) for msgs in streams]
    todo = iter(contexts)

    async def worker() -> None:
        for ctx in todo:
            await process(None, ctx)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return contexts


async def _settled(gw: Gateway) -> None:
    """Wait until the background settlements have been taken by Redis (bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        batcher = gw.background._batcher
        if not gw.background.pending and (batcher is None or len(batcher) == 0):
            return
        await asyncio.sleep(0.001)
    raise RuntimeError("settlements still pending after 10 s")


async def measure(
    arm: str,
    process: Process,
    gw: Gateway | None,
    *,
    count: int,
    concurrency: int,
    serial: list[int],
    profiler: cProfile.Profile | None = None,
) -> dict[str, float]:
    """CPU µs per stream of each length, and the per-chunk slope between them."""
    out: dict[str, float] = {}
    for chunks in LENGTHS:
        streams = []
        for _ in range(count):
            serial[0] += 1
            streams.append(stream_messages(chunks, serial[0]))
        cpu0 = time.process_time()
        if profiler is not None and chunks == LENGTHS[-1]:
            profiler.enable()
        ctxs = await run_streams(process, streams, concurrency)
        if gw is not None:
            await _settled(gw)
        if profiler is not None:
            profiler.disable()
        cpu = time.process_time() - cpu0
        if any(c.written == 0 for c in ctxs):
            raise RuntimeError(f"{arm}: a stream got no reply")
        out[f"cpu_per_stream_{chunks}"] = 1e6 * cpu / count
    a, b = LENGTHS
    out["per_chunk"] = (out[f"cpu_per_stream_{b}"] - out[f"cpu_per_stream_{a}"]) / (b - a)
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


async def run(
    streams: int, concurrency: int, rounds: int, profile: str | None, every: int = 64
) -> dict[str, Any]:
    """Start Redis, run the arms alternately, return the results."""
    with tempfile.TemporaryDirectory(prefix="aiq-chunk-micro-") as tmp:
        proc, port = _start_redis(Path(tmp))
        cfg = load_config_text(orjson.dumps(bench_rules(every=every)).decode())
        clock, metrics = SystemClock(), Metrics()
        # built as ``ai-quota serve`` builds it (extproc.app.start)
        lim = RedisLimiter.from_url(
            f"redis://127.0.0.1:{port}/0",
            timeout_ms=cfg.redis_timeout_ms,
            cooldown_ms=cfg.breaker_cooldown_ms,
            clock=clock,
            metrics=metrics,
        )
        try:
            gw = Gateway(config=cfg, limiter=lim, clock=clock, metrics=metrics)
            gw.install(cfg, "micro")
            real = ExternalProcessorServicer(gw)
            floor = FloorServicer()
            arms: dict[str, tuple[Process, Gateway | None]] = {
                "gateway": (real.Process, gw),
                "floor": (floor.Process, None),
            }
            serial = [0]
            for name, (process, g) in arms.items():  # warm-up: connections, scripts, caches
                await measure(name, process, g, count=8, concurrency=concurrency, serial=serial)
            gc.collect()
            gc.freeze()
            results: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
            for r in range(rounds):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for name in order:
                    process, g = arms[name]
                    results[name].append(
                        await measure(
                            name,
                            process,
                            g,
                            count=streams,
                            concurrency=concurrency,
                            serial=serial,
                        )
                    )
            prof_text = None
            if profile:
                profiler = cProfile.Profile()
                await measure(
                    "gateway",
                    real.Process,
                    gw,
                    count=streams,
                    concurrency=concurrency,
                    serial=serial,
                    profiler=profiler,
                )
                profiler.dump_stats(profile)
                buf = io.StringIO()
                pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(30)
                prof_text = buf.getvalue()
            await gw.background.drain_settlements(5.0)
        finally:
            await lim.close()
            proc.terminate()
            proc.wait(10)
    summary = {arm: {k: _stats([x[k] for x in rs]) for k in rs[0]} for arm, rs in results.items()}
    ratios = [
        g["per_chunk"] / f["per_chunk"]
        for g, f in zip(results["gateway"], results["floor"], strict=True)
        if f["per_chunk"] > 0
    ]
    return {
        "kind": "chunk-micro",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg": os.getloadavg(),
        },
        "params": {
            "streams_per_round": streams,
            "concurrency": concurrency,
            "rounds": rounds,
            "lengths": list(LENGTHS),
            "every": every,
        },
        "us": summary,
        "ratio_per_chunk": _stats(ratios) if ratios else None,
        "rounds": results,
        "profile_top": prof_text,
    }


def _drive_handle(proc: RequestProcessor, body: list[Any]) -> None:
    for m in body:
        coro = proc.handle(m)
        try:
            coro.send(None)
        except StopIteration as done:
            for resp in done.value:
                resp.SerializeToString()
        else:  # pragma: no cover - the common chunk never awaits
            coro.close()
            raise RuntimeError("a plain chunk awaited")


def _drive_floor(proc: RequestProcessor, body: list[Any]) -> None:
    stream = FloorStream()
    stream.duplex = True  # past an SSE response's headers: chunks are echoed back
    for m in body:
        stream.answer(m).SerializeToString()


async def handle_only(rounds: int, chunks: int = 2000) -> dict[str, Any]:
    """CPU µs per chunk of ``RequestProcessor.handle`` alone (plus serializing its replies),
    driven without an event loop (the common chunk never awaits), against the floor's
    ``answer``; no Redis (the in-memory limiter, no charge within the stream), best of
    ``rounds``: the pure-Python part of the path, steady enough to attribute each change."""
    cfg = load_config_text(orjson.dumps(bench_rules(every=100_000)).decode())
    clock = SystemClock()
    gw = Gateway(config=cfg, limiter=MemoryLimiter(clock), clock=clock, metrics=Metrics())
    gw.install(cfg, "micro")
    best = {"handle": float("inf"), "floor": float("inf")}
    for r in range(rounds):
        msgs = stream_messages(chunks, r)
        proc = RequestProcessor(gw)
        for m in msgs[:3]:  # request headers, body, response headers
            await proc.handle(m)
        body = msgs[4 : 4 + chunks - 10]  # plain delta chunks

        for name, f in (("handle", _drive_handle), ("floor", _drive_floor)):
            gc.disable()
            t0 = time.process_time()
            f(proc, body)
            cpu = time.process_time() - t0
            gc.enable()
            best[name] = min(best[name], 1e6 * cpu / len(body))
    return {
        "kind": "chunk-micro-handle",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "us_per_chunk_best": {k: round(v, 2) for k, v in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python tests/benchmark/bench_chunk.py``."""
    p = argparse.ArgumentParser(prog="python tests/benchmark/bench_chunk.py", description=__doc__)
    p.add_argument("--streams", type=int, default=16, help="streams per length, arm and round")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent streams")
    p.add_argument("--rounds", type=int, default=7, help="A/B rounds")
    p.add_argument("--every", type=int, default=64, help="charge every N tokens (the rules')")
    p.add_argument("--profile", help="write a cProfile of the gateway arm here")
    p.add_argument(
        "--handle-only",
        action="store_true",
        help="time RequestProcessor.handle alone, without event loop or Redis",
    )
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("streams", "concurrency", "rounds", "every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    configure_logging("json", "info")  # as ``ai-quota serve`` runs
    if os.environ.get("AIQ_EVENT_LOOP", "uvloop") != "asyncio":
        import uvloop

        uvloop.install()
    if args.handle_only:
        result = asyncio.run(handle_only(args.rounds))
    else:
        result = asyncio.run(
            run(args.streams, args.concurrency, args.rounds, args.profile, args.every)
        )
    prof = result.pop("profile_top", None)
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if prof:
        print(prof, file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


@pytest.mark.benchmark
async def test_quick_pass_measures_both_arms() -> None:
    """One round of each arm: every stream answered, a per-chunk figure for each arm."""
    result = await run(streams=2, concurrency=2, rounds=1, profile=None)
    for arm in ("gateway", "floor"):
        assert result["rounds"][arm][0]["cpu_per_stream_500"] > 0
        assert "per_chunk" in result["us"][arm]


@pytest.mark.benchmark
async def test_handle_only_drives_plain_chunks_without_awaiting() -> None:
    """handle() answers every plain chunk without awaiting (or the run raises)."""
    result = await handle_only(rounds=1, chunks=200)
    assert set(result["us_per_chunk_best"]) == {"handle", "floor"}


if __name__ == "__main__":
    sys.exit(main())
