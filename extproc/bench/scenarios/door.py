"""Section "door", the price of a closed gRPC port (docs/security.md): the processor's CPU per
non-streaming request and per streamed chunk with TLS + Envoy's bearer token and with mutual TLS,
against the same processor serving plaintext without credentials (``--insecure``), in the same
run.  Each arm is its own stack (Redis shared); the arms alternate within each round, and each
round's ratio is taken between batches that saw about the same machine."""

from __future__ import annotations

import asyncio
from functools import partial

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, US, batch, interleave, med_rounds, ok_count
from extproc.bench.plan import Bench
from extproc.bench.report import Row, per_unit_split
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack
from extproc.stats import median

#: The non-streaming shape of the admission section; streams of two lengths split a streamed
#: request's CPU into a fixed part and a part per chunk.
UNARY = Shape(prompt_tokens=1000, max_tokens=8)
LENGTHS = (50, 500)
SETTLE_S = 0.15
ARMS = {"plaintext": "insecure", "TLS + token": "token", "mutual TLS": "mtls"}


async def door(b: Bench, stacks: dict[str, Stack]) -> None:
    """CPU per non-streaming request and per chunk, each closed arm against plaintext."""
    n, c = b.plan.fixed_requests, b.plan.fixed_concurrency
    m, sc = b.plan.cpu_streams, b.plan.cpu_concurrency
    meters = {a: system.CpuMeter(system.proc_pids(s, "extproc")) for a, s in stacks.items()}
    b.log(f"door: {n} requests at c={c}, {m} streams of {LENGTHS} at c={sc}, x {b.plan.rounds}")

    async def one_round(arm: str) -> dict[str, float]:
        stack, meter = stacks[arm], meters[arm]
        out: dict[str, float] = {}
        meter.start()
        rs = await batch(stack.base_url, KEY, UNARY, count=n, concurrency=c)
        await asyncio.sleep(SETTLE_S)
        out["cpu_per_req_us"] = meter.stop() / max(1, len(rs)) * US
        errors = len(rs) - ok_count(rs)
        for chunks in LENGTHS:
            shape = Shape(prompt_tokens=100, max_tokens=chunks, stream=True, itl_ms=1)
            meter.start()
            rs = await batch(stack.base_url, KEY, shape, count=m, concurrency=sc)
            await asyncio.sleep(SETTLE_S)
            cpu = meter.stop()
            out[f"cpu_per_stream_{chunks}"] = cpu / max(1, len(rs))
            out[f"tokens_per_stream_{chunks}"] = sum(r.tokens for r in rs) / max(1, len(rs))
            errors += len(rs) - ok_count(rs)
        _, per_chunk = per_unit_split(
            out["cpu_per_stream_50"],
            out["cpu_per_stream_500"],
            out["tokens_per_stream_50"],
            out["tokens_per_stream_500"],
        )
        out["cpu_per_chunk_us"] = per_chunk * US
        out["errors"] = float(errors)
        return out

    rounds = await interleave(b.plan.rounds, {a: partial(one_round, a) for a in stacks})
    med = {a: {k: med_rounds([r[k] for r in rs]) for k in rs[0]} for a, rs in rounds.items()}
    b.raw["door"] = {"rounds": rounds, "median": med, "arms": dict(ARMS)}
    base = "plaintext"
    for arm in (a for a in stacks if a != base):
        for key, what, unit in (
            ("cpu_per_req_us", "processor CPU per non-streaming request", "µs"),
            ("cpu_per_chunk_us", "processor CPU per chunk", "µs"),
        ):
            ratios = [
                g[key] / p[key]
                for g, p in zip(rounds[arm], rounds[base], strict=True)
                if p[key] > 0
            ]
            note = (
                f"ratio per round: median {median(ratios):.2f}x, "
                f"{min(ratios):.2f}-{max(ratios):.2f}x"
                if ratios
                else ""
            )
            failed = int(sum(r["errors"] for r in rounds[arm]))
            if failed:
                note += f"; {failed} failed requests"
            b.table.add(
                Row(
                    "door (TLS + credentials)",
                    f"{what}: {arm} (base = plaintext)",
                    unit,
                    med[arm][key],
                    med[base][key],
                    note=note,
                )
            )


async def measure(b: Bench, stacks: Stacks) -> None:
    """One stack per arm (the first's Redis shared), warmed, then measured alternately."""
    b.log("starting the door stacks (plaintext, TLS + token, mutual TLS)")
    arms: dict[str, Stack] = {}
    redis_url: str | None = None
    for name, security in ARMS.items():
        tag = security.replace("insecure", "plain")
        arms[name] = await stacks.start(f"door-{tag}", security=security, redis_url=redis_url)
        redis_url = redis_url or arms[name].effective_redis_url
    for s in arms.values():
        await batch(s.base_url, KEY, Shape(), count=20, concurrency=4)
        await batch(s.base_url, KEY, Shape(stream=True, max_tokens=20), count=10, concurrency=4)
    await door(b, arms)


SCENARIO = Scenario("door", measure)
