"""The ``engine`` bench section: the gateway's bills against a real engine's own count.

Runs when vLLM is installed (``scripts/setup --engine``): vLLM's CPU build serving the tiny
local model (:mod:`extproc.bench.vllm`) on one core, Redis + processor + Envoy on the others.
Three figures, each against the engine's ``/metrics``:

* **bill drift**: counter - (engine prompt + generation) over completed requests of each API,
  streamed and not (target 0: the tenant pays what the engine computed);
* **strict utilisation**: what a strict-mode tenant received by the engine's count (prompt +
  tokens delivered, counted from per-token logprobs) over its limit (target >= 99 %, <= 100 %);
* **run-ahead**: generated - delivered per cut stream (tokens the engine computed that no client
  received), one stream and eight at once, lazy and strict; and, with the processor frozen
  mid-stream, what the engine generated beyond the tenant's room.

``python -m extproc.bench.engine`` prints the figures as JSON.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from extproc.bench.vllm import (
    RUN_AHEAD_BOUND,
    SERVED_NAME,
    Engine,
    EngineError,
    EngineMetrics,
    engine_python,
    pin_self,
    split_cpus,
    start_gateway,
    wait_idle,
    wait_metrics,
    wait_settled,
)
from extproc.stack import Stack

PROMPT = "Tell me a long story about quotas."


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int
    delivered: int = 0  # tokens received, by the engine's count (logprobs entries), chat only
    usage: tuple[int, int] | None = None  # (prompt, completion) the response reported
    cut: bool = False  # an error event ended the stream


def _body(api: str, stream: bool, max_tokens: int, logprobs: bool = False) -> dict[str, Any]:
    if api == "chat":
        b: dict[str, Any] = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        if logprobs:
            b["logprobs"] = True
    elif api == "completions":
        b = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    elif api == "responses":
        b = {
            "model": SERVED_NAME,
            "input": PROMPT,
            "max_output_tokens": max_tokens,
            "ignore_eos": True,
        }
    else:
        b = {
            "model": SERVED_NAME,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": PROMPT}],
        }
    if stream:
        b["stream"] = True
        if api in ("chat", "completions"):
            b["stream_options"] = {"include_usage": True}
    return b


PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def _usage_of(api: str, obj: dict[str, Any]) -> tuple[int, int] | None:
    u = obj.get("usage")
    if api == "responses" and isinstance(obj.get("response"), dict):
        u = obj["response"].get("usage")
    if api == "messages" and isinstance(obj.get("message"), dict):
        u = obj["message"].get("usage")
    if not isinstance(u, dict):
        return None
    if "prompt_tokens" in u:
        return int(u["prompt_tokens"]), int(u.get("completion_tokens") or 0)
    if "input_tokens" in u:
        return int(u["input_tokens"]), int(u.get("output_tokens") or 0)
    return None


async def request(
    session: aiohttp.ClientSession,
    base: str,
    key: str,
    api: str,
    *,
    stream: bool,
    max_tokens: int,
    logprobs: bool = False,
    on_tokens: Callable[[int], None] | None = None,
) -> Outcome:
    """One request through the gateway, read to its end (SSE parsed line by line);
    ``on_tokens`` is called with the tokens received so far as they arrive."""
    headers = {"authorization": f"Bearer {key}", "x-api-key": key}
    if api == "messages":
        headers["anthropic-version"] = "2023-06-01"
    body = _body(api, stream, max_tokens, logprobs)
    async with session.post(f"{base}{PATHS[api]}", json=body, headers=headers) as r:
        out = Outcome(r.status)
        if r.status != 200:
            await r.read()
            return out
        if not stream:
            out.usage = _usage_of(api, await r.json())
            return out
        try:
            await _read_events(r, api, out, on_tokens)
        except aiohttp.ClientPayloadError:
            # the gateway aborts the response after a cut's error event (so every client
            # counts the cut as an error): the event was read, the abort ends the body
            if not out.cut:
                raise
        return out


async def _read_events(
    r: aiohttp.ClientResponse,
    api: str,
    out: Outcome,
    on_tokens: Callable[[int], None] | None,
) -> None:
    """Read one SSE response's events into ``out`` (tokens delivered, usage, whether cut).
    Messages streams split usage: input in message_start, output in message_delta."""
    msg_in = 0
    async for raw in r.content:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj or obj.get("type") == "error":
            out.cut = True
            continue
        for choice in obj.get("choices") or []:
            lp = choice.get("logprobs") or {}
            out.delivered += len(lp.get("content") or [])
        if on_tokens is not None:
            on_tokens(out.delivered)
        if api == "messages":
            if obj.get("type") == "message_start":
                msg_in = int(obj["message"]["usage"]["input_tokens"])
            elif obj.get("type") == "message_delta":
                out.usage = (msg_in, int(obj["usage"]["output_tokens"]))
        else:
            u = _usage_of(api, obj)
            if u is not None:
                out.usage = u


@dataclass
class EngineBench:
    """Figures of one run (JSON-able)."""

    drift: dict[str, dict[str, int]] = field(default_factory=dict)
    strict: dict[str, Any] = field(default_factory=dict)
    run_ahead: dict[str, dict[str, Any]] = field(default_factory=dict)
    lagging: dict[str, Any] = field(default_factory=dict)
    engine_start_s: float = 0.0


def _delta(engine: Engine, before: EngineMetrics) -> EngineMetrics:
    wait_metrics(engine.metrics_url, lambda m: m.running == 0 and m.waiting == 0, timeout=15)
    return wait_idle(engine.metrics_url) - before


async def drift(
    res: EngineBench, engine: Engine, gw: Stack, rds: redis.Redis, requests: int
) -> None:
    """counter - engine (prompt + generation) per API, streamed and not."""
    async with aiohttp.ClientSession() as s:
        for api in PATHS:
            for stream in (False, True):
                name = f"{api}{'stream' if stream else ''}"
                before = wait_idle(engine.metrics_url)
                outs = [
                    await request(
                        s,
                        gw.base_url.removesuffix("/v1"),
                        f"sk-{name}",
                        api,
                        stream=stream,
                        max_tokens=120,
                    )
                    for _ in range(requests)
                ]
                billed = await asyncio.to_thread(wait_settled, rds, f"e-{name}")
                d = _delta(engine, before)
                reported = sum(sum(o.usage) for o in outs if o.usage)
                res.drift[name] = {
                    "requests": requests,
                    "ok": sum(1 for o in outs if o.status == 200),
                    "billed": billed,
                    "engine_prompt": d.prompt_tokens,
                    "engine_generation": d.generation_tokens,
                    "reported_usage": reported,
                    "drift": billed - d.tokens,
                }


async def cuts(
    res: EngineBench, engine: Engine, gw: Stack, rds: redis.Redis, concurrency: int
) -> None:
    """Cut streams, lazy and strict, one and ``concurrency`` at once: run-ahead and the strict
    tenant's utilisation by the engine's count."""
    base = gw.base_url.removesuffix("/v1")
    async with aiohttp.ClientSession() as s:
        for name, limit, n in (
            ("cutlazy", 300, 1),
            ("cutstrict", 300, 1),
            ("conclazy", 1500, concurrency),
            ("concstrict", 1500, concurrency),
        ):
            before = wait_idle(engine.metrics_url)
            outs = await asyncio.gather(
                *(
                    request(
                        s, base, f"sk-{name}", "chat", stream=True, max_tokens=1000, logprobs=True
                    )
                    for _ in range(n)
                )
            )
            t_cut = time.monotonic()
            d = _delta(engine, before)
            idle_s = time.monotonic() - t_cut
            billed = await asyncio.to_thread(wait_settled, rds, f"e-{name}")
            delivered = sum(o.delivered for o in outs)
            cut = [o for o in outs if o.cut]
            excess = d.generation_tokens - delivered
            res.run_ahead[name] = {
                "streams": n,
                "cut": len(cut),
                "engine_prompt": d.prompt_tokens,
                "engine_generation": d.generation_tokens,
                "delivered": delivered,
                "run_ahead_total": excess,
                "run_ahead_per_cut": round(excess / max(1, len(cut)), 1),
                "billed": billed,
                "billed_minus_delivered": billed - (d.prompt_tokens + delivered),
                "engine_idle_after_s": round(idle_s, 3),
            }
            if name.endswith("strict"):
                got = d.prompt_tokens + delivered
                res.strict[name] = {
                    "limit": limit,
                    "received_by_engine_count": got,
                    "utilisation": round(got / limit, 4),
                    "billed": billed,
                }


async def lagging(
    res: EngineBench, engine: Engine, gw: Stack, rds: redis.Redis, limit: int = 100
) -> None:
    """A stream whose processor freezes (SIGSTOP) after 10 delivered tokens, until the engine
    has generated ``limit + RUN_AHEAD_BOUND`` or for 3 s: what the engine computed against the
    tenant's room (vLLM keeps generating for a reader that stops)."""
    base = gw.base_url.removesuffix("/v1")
    before = wait_idle(engine.metrics_url)
    started = asyncio.Event()

    def on_tokens(n: int) -> None:
        if n >= 10:
            started.set()

    async with aiohttp.ClientSession() as s:
        reader = asyncio.create_task(
            request(
                s,
                base,
                "sk-lagging",
                "chat",
                stream=True,
                max_tokens=1500,
                logprobs=True,
                on_tokens=on_tokens,
            )
        )
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([reader, waiter], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        gw.signal("extproc0", signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            frozen = await asyncio.to_thread(
                _wait_generated, engine, before, limit + RUN_AHEAD_BOUND, 3.0
            )
        finally:
            gw.signal("extproc0", signal.SIGCONT)
        frozen_s = time.monotonic() - t0
        out = await reader
    d = _delta(engine, before)
    billed = await asyncio.to_thread(wait_settled, rds, "e-lagging")
    res.lagging = {
        "limit": limit,
        "room": limit - d.prompt_tokens,
        "frozen_s": round(frozen_s, 3),
        "generated_while_frozen": frozen.generation_tokens - before.generation_tokens,
        "engine_generation": d.generation_tokens,
        "delivered": out.delivered,
        "cut": out.cut,
        "generated_beyond_room": d.generation_tokens - (limit - d.prompt_tokens),
        "billed_minus_delivered": billed - (d.prompt_tokens + out.delivered),
    }


def _wait_generated(
    engine: Engine, before: EngineMetrics, tokens: int, timeout: float
) -> EngineMetrics:
    try:
        return wait_metrics(
            engine.metrics_url,
            lambda m: m.generation_tokens - before.generation_tokens >= tokens,
            timeout=timeout,
        )
    except EngineError:
        return engine.metrics()


async def measure(
    workdir: Path, *, requests: int = 3, concurrency: int = 8, log: Any = None
) -> EngineBench:
    """Start the engine and a gateway in front of it, measure, stop both."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    py = engine_python()
    if py is None:
        raise RuntimeError("vLLM is not installed: run scripts/setup --engine")
    engine_cpus, gateway_cpus = split_cpus()
    before = pin_self(gateway_cpus)
    engine = Engine(workdir=workdir / "vllm", cpuset=engine_cpus, python=py)
    gw: Stack | None = None
    res = EngineBench()
    try:
        say(f"engine: starting vLLM on CPUs {sorted(engine_cpus)}")
        await asyncio.to_thread(engine.start)
        res.engine_start_s = round(engine.started_s, 1)
        gw = await asyncio.to_thread(start_gateway, workdir / "gateway", engine)
        rds = redis.Redis(port=gw.ports.redis, decode_responses=True)
        say("engine: bills against the engine's count, every API")
        await drift(res, engine, gw, rds, requests)
        say("engine: cut streams (run-ahead, strict utilisation)")
        await cuts(res, engine, gw, rds, concurrency)
        say("engine: a stream whose processor freezes")
        await lagging(res, engine, gw, rds)
    finally:
        if gw is not None:
            gw.stop()
        engine.stop()
        pin_self(before)
    return res


async def bench_section(bench: Any) -> None:
    """The ``engine`` bench section (``bench`` is an ``extproc.bench.runner.Bench``); skipped
    with a note when vLLM is not installed."""
    from extproc.bench.report import Row

    if engine_python() is None:
        bench.log("engine: skipped (vLLM not installed: scripts/setup --engine)")
        return
    res = await measure(bench.workdir / "engine", log=bench.log)
    for name, d in res.drift.items():
        bench.table.add(
            Row(
                "9 engine",
                f"counter - engine (prompt + generation), {d['requests']} completed {name}",
                "tokens",
                float(d["drift"]),
                target="0",
                met=d["drift"] == 0,
                note=f"billed {d['billed']}, engine {d['engine_prompt']} + {d['engine_generation']}",
            )
        )
    for name, st in res.strict.items():
        bench.table.add(
            Row(
                "9 engine",
                f"strict utilisation by the engine's count ({name})",
                "%",
                100.0 * st["utilisation"],
                target=">= 99, <= 100",
                met=0.99 <= st["utilisation"] <= 1.0,
                note=f"received {st['received_by_engine_count']} of {st['limit']}",
            )
        )
    for name, ra in res.run_ahead.items():
        bench.table.add(
            Row(
                "9 engine",
                f"run-ahead per cut stream, generated - delivered ({name})",
                "tokens",
                float(ra["run_ahead_per_cut"]),
                target=f"<= {RUN_AHEAD_BOUND}",
                met=ra["run_ahead_per_cut"] <= RUN_AHEAD_BOUND,
                note=f"{ra['cut']}/{ra['streams']} cut; billed - delivered {ra['billed_minus_delivered']}",
            )
        )
    lag = res.lagging
    if lag:
        bench.table.add(
            Row(
                "9 engine",
                "tokens the engine generated beyond the tenant's room, processor frozen",
                "tokens",
                float(lag["generated_beyond_room"]),
                target=f"<= {RUN_AHEAD_BOUND}",
                met=lag["generated_beyond_room"] <= RUN_AHEAD_BOUND,
                note=f"room {lag['room']}, frozen {lag['frozen_s']} s, "
                f"{lag['generated_while_frozen']} generated meanwhile, {lag['delivered']} delivered",
            )
        )
    bench.raw["engine"] = asdict(res)


def main() -> int:
    """Measure and print the figures as JSON."""
    with tempfile.TemporaryDirectory(prefix="aiq-engine-") as d:
        res = asyncio.run(measure(Path(d)))
    print(json.dumps(asdict(res), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
