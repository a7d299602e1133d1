"""Section 3, Redis round trips: limiter calls (INFO commandstats) per streamed and per
non-streaming request."""

from __future__ import annotations

import asyncio
import os
from hashlib import sha1
from typing import Any

import redis

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch, ok_count
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.limiter.scripts import load_script
from extproc.records.writer import _APPEND_LUA
from extproc.stack import Stack

#: Issue 17's targets: round trips per non-streaming request, and per stream beyond output / N.
NON_STREAM_CALLS = 1.2
STREAM_EXTRA_CALLS = 1.2
#: Issue 35's, with local allowances (the default): the limiter's round trips per warm
#: non-streaming request and per warm 500-token stream (the usage recorder's batched appends,
#: one call per 50 ms of traffic whatever the number of requests, are reported beside them).
WARM_NON_STREAM_CALLS = 0.1
WARM_STREAM_CALLS = 1.0


def stream_target(output_tokens: int, every: int) -> float:
    """Round trips a stream of ``output_tokens`` may take with a charge every ``every`` tokens
    (output / N + 1.2), to two decimals (500 tokens at N = 64: 9.01)."""
    return round(output_tokens / every + STREAM_EXTRA_CALLS, 2)


async def round_trips(b: Bench, main: Stack) -> None:
    """Limiter calls (INFO commandstats) per streamed and per non-streaming request."""
    raw: dict[str, Any] = {}
    every = b.plan.every
    streamed = Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1)
    cases = (
        (
            f"streamed, {streamed.max_tokens} tokens",
            streamed,
            20,
            stream_target(streamed.max_tokens, every),
        ),
        ("non-streaming", Shape(prompt_tokens=1000, max_tokens=8), 50, NON_STREAM_CALLS),
    )
    for name, shape, n, bound in cases:
        before = system.redis_calls(main.ports.redis)
        rs = await batch(main.base_url, KEY, shape, count=n, concurrency=4)
        await asyncio.sleep(0.3)
        after = system.redis_calls(main.ports.redis)
        calls = system.limiter_round_trips(before, after)
        per = sum(calls.values()) / max(1, ok_count(rs))
        raw[name] = {
            "requests": len(rs),
            "ok": ok_count(rs),
            "calls": calls,
            "per_request": per,
            "target": bound,
        }
        b.table.add(
            Row(
                "3 redis",
                f"round trips per request, {name}",
                "calls",
                per,
                goal=Target("value", "<=", bound, "calls"),
                note=", ".join(
                    f"{k} {v / max(1, ok_count(rs)):.2f}" for k, v in sorted(calls.items())
                ),
            )
        )
    raw["charge_every_tokens"] = every
    raw["warm"] = await warm_limiter_calls(b, main)
    b.raw["redis"] = raw


async def warm_limiter_calls(b: Bench, main: Stack) -> dict[str, Any]:
    """The limiter's script calls per request once the tenant is warm for the shape measured
    (50 requests of it first, unmeasured), told apart by SHA in Redis's slow log (threshold 0
    for these batches only, then restored): 100 non-streaming requests, then 20 streams of
    500 tokens after 20 unmeasured ones."""
    out: dict[str, Any] = {}
    cases = (
        ("non-streaming", Shape(prompt_tokens=1000, max_tokens=8), 50, 100, WARM_NON_STREAM_CALLS),
        (
            "streamed, 500 tokens",
            Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1),
            20,
            20,
            WARM_STREAM_CALLS,
        ),
    )
    rds = redis.Redis(port=main.ports.redis)
    got = rds.config_get("slowlog-*")
    old = str(got.get("slowlog-log-slower-than", "10000"))
    old_len = str(got.get("slowlog-max-len", "128"))
    try:
        for name, shape, warm, n, bound in cases:
            await batch(main.base_url, KEY, shape, count=warm, concurrency=4)
            rds.config_set("slowlog-log-slower-than", 0)
            rds.config_set("slowlog-max-len", 100_000)
            rds.slowlog_reset()
            rs = await batch(main.base_url, KEY, shape, count=n, concurrency=4)
            await asyncio.sleep(0.3)
            scripts = script_calls(rds)
            rds.config_set("slowlog-log-slower-than", old)
            ok = max(1, ok_count(rs))
            row = limiter_row(
                f"limiter round trips per request, {name}, warm (after {warm})",
                scripts,
                sum(scripts.values()),
                ok,
                bound,
            )
            b.table.add(row)
            out[name] = {"warm_up": warm, "requests": len(rs), "ok": ok_count(rs)}
            out[name] |= {"scripts": scripts, "limiter_per_request": row.value}
    finally:
        rds.config_set("slowlog-log-slower-than", old)
        rds.config_set("slowlog-max-len", old_len)
        rds.close()
    return out


async def pair_streams(b: Bench, stacks: Stacks) -> None:
    """The streamed case on a stack of two processors behind one Envoy (local allowances, on
    unless ``AIQ_ALLOWANCES=0`` is in the environment the processors inherit, are per processor):
    20 streams of a fresh tenant (its warm-up included), then twice 20 more, each batch a row;
    with allowances the two warm batches are held to issue 35's one call a stream, otherwise
    (and the warm-up) to issue 17's bound."""
    every = b.plan.every
    shape = Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1)
    bound = stream_target(shape.max_tokens, every)
    # on by default (issue 35): off only when the processors inherit a false AIQ_ALLOWANCES
    off = ("0", "false", "no", "off", "f", "n")
    allowances = os.environ.get("AIQ_ALLOWANCES", "1").strip().lower() not in off
    st = await stacks.start("redis-pair", extprocs=2)
    raw: dict[str, Any] = {}
    rds = redis.Redis(port=st.ports.redis)
    try:
        # every command logged (a few thousand at most): the script calls told apart by SHA
        rds.config_set("slowlog-log-slower-than", 0)
        rds.config_set("slowlog-max-len", 100_000)
        for name in ("warm-up included", "after 20 streams", "after 40 streams"):
            rds.slowlog_reset()
            before = system.redis_calls(st.ports.redis)
            rs = await batch(st.base_url, KEY, shape, count=20, concurrency=4)
            await asyncio.sleep(0.3)
            calls = system.limiter_round_trips(before, system.redis_calls(st.ports.redis))
            ok = max(1, ok_count(rs))
            scripts = script_calls(rds)
            row = limiter_row(
                f"limiter round trips per stream, 500 tokens, 2 processors, {name}",
                scripts,
                sum(calls.values()),
                ok,
                # warm (after the first 20), with allowances: issue 35's target
                WARM_STREAM_CALLS if allowances and name != "warm-up included" else bound,
            )
            b.table.add(row)
            raw[name] = {"requests": len(rs), "ok": ok_count(rs), "calls": calls}
            raw[name] |= {"per_request": sum(calls.values()) / ok, "scripts": scripts}
            raw[name] |= {"limiter_per_request": row.value}
    finally:
        rds.close()
        st.stop()
    raw["allowances"] = allowances
    b.raw.setdefault("redis", {})["two_processors"] = raw


LIMITER_SCRIPTS = ("admit", "charge", "settle", "note", "allowance", "tranche", "drafts")


def limiter_row(what: str, scripts: dict[str, int], every: int, ok: int, bound: float) -> Row:
    """The row of the limiter's script calls per answered request (``scripts``: calls by
    script over ``ok`` answers; ``every``: every script call, record appends included)."""
    limiter = sum(v for k, v in scripts.items() if k in LIMITER_SCRIPTS)
    return Row(
        "3 redis",
        what,
        "calls",
        limiter / ok,
        goal=Target("value", "<=", bound, "calls"),
        note=", ".join(f"{k} {v / ok:.2f}" for k, v in sorted(scripts.items()))
        + f"; all evalsha incl. record appends {every / ok:.2f}",
    )


def script_calls(rds: redis.Redis) -> dict[str, int]:
    """Script calls in Redis's slow log (every command logged), by script: the limiter's by
    name, the usage recorder's appends as ``records``, any other by its SHA's first 8."""
    names = {
        sha1(load_script(n).encode(), usedforsecurity=False).hexdigest(): n for n in LIMITER_SCRIPTS
    }
    names[sha1(_APPEND_LUA.encode(), usedforsecurity=False).hexdigest()] = "records"
    out: dict[str, int] = {}
    for entry in rds.slowlog_get(100_000):
        cmd = entry["command"].split()
        if cmd and cmd[0].lower() == b"evalsha" and len(cmd) > 1:
            name = names.get(cmd[1].decode(), cmd[1].decode()[:8])
            out[name] = out.get(name, 0) + 1
    return out


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack, then the streamed case on two processors."""
    await round_trips(b, stacks.shared)
    await pair_streams(b, stacks)


SCENARIO = Scenario("redis", measure, on_main=True)
