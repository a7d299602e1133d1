"""Sections 5 and 6, accuracy under load and upstream stop latency: many concurrent streams of
one tenant through 2 Envoys x 2 processors until its quota runs out (TPM and money budget,
lazy and strict), the worst one-second span across a window boundary (fixed versus sliding
windows), and how fast a cut stream's upstream is disconnected."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson

from extproc.bench import system
from extproc.bench.client import Result, Shape, connector, send
from extproc.bench.drivers import MS
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.sim.records import SimRecord
from extproc.stack import Stack
from extproc.stats import percentile


async def _wait_window(b: Bench, seconds: float = 45.0) -> None:
    left = 3600 - time.time() % 3600
    if left < seconds:
        b.log(f"waiting {left:.0f}s for the next hourly window")
        await asyncio.sleep(left + 1)


#: Micro-dollars per input and output token in the bench rules' price table ($1 and $4 per
#: million); a budget tenant's limit is worth ``acc_limit`` output tokens.
PRICE_IN, PRICE_OUT = 1, 4


async def accuracy(b: Bench, stack: Stack) -> None:
    """Many concurrent streams of one tenant until its quota runs out: a TPM limit and a money
    budget, each lazy and strict (judged on what reached clients, in the limit's own units)."""
    from extproc.config import load_config
    from extproc.core.apis.openai.counting import count_chat_request

    cfg = load_config(stack.config)
    model = cfg.models["sim-small"]
    limit = b.plan.acc_limit
    conc = b.plan.acc_concurrency
    shape = Shape(prompt_tokens=100, max_tokens=1000, stream=True, itl_ms=5)
    raw: dict[str, Any] = {}
    stops: list[float] = []
    gaps: list[float] = []
    for mode in ("lazy", "strict", "budget-lazy", "budget-strict"):
        money = mode.startswith("budget")
        # in the limit's units: tokens, or micro-dollars at the bench's prices
        p_in, p_out = (PRICE_IN, PRICE_OUT) if money else (1, 1)
        limit = b.plan.acc_limit * (PRICE_OUT if money else 1)
        await _wait_window(b)
        window = int(time.time() // 3600)
        b.log(
            f"accuracy ({mode}): {conc} streams through 2 Envoys x 2 processors, "
            f"limit {limit} {'micro-dollars' if money else 'tokens'} per window"
        )
        results: list[tuple[Result, int]] = []
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=connector(conc)) as session:

            async def worker(
                i: int,
                mode: str = mode,
                started: float = started,
                results: list[tuple[Result, int]] = results,
            ) -> None:
                url = f"http://127.0.0.1:{stack.envoy_ports[i % 2]}/v1"
                for j in range(4):
                    if time.monotonic() - started > 40:
                        return
                    n = i * 10 + j
                    body = shape.body(n)
                    prompt = count_chat_request(orjson.loads(body), model.counter, model.tokenizer)
                    r = await send(
                        session,
                        url,
                        f"sk-{mode}",
                        shape,
                        body=body,
                        client_request_id=b.rid(mode),
                        limit_s=45,
                    )
                    results.append((r, prompt))
                    if r.status != 200 or r.cut:
                        return

            await asyncio.gather(*(worker(i) for i in range(conc)))
        elapsed = time.monotonic() - started
        # Ground truth: wait for the simulator to finish every record of this run.
        ids = {r.client_request_id for r, _ in results}
        recs: dict[str, SimRecord] = {}
        for _ in range(30):
            recs = {
                x.client_request_id: x
                for x in system.sim_records(stack.sim_url)
                if x.client_request_id in ids
            }
            if all(x.finished for x in recs.values()):
                break
            await asyncio.sleep(0.2)
        # what the gateway bills for a prompt: the upstream's own figure when the response
        # completed with its usage (the simulator's leaves out the role tokens), else its count
        admitted = [
            (r, _billed_prompt(r, p, recs.get(r.client_request_id)))
            for r, p in results
            if r.status == 200
        ]
        prompt_total = sum(p for _, p in admitted)
        delivered = sum(r.tokens for r, _ in admitted)
        upstream = sum(
            recs[r.client_request_id].tokens_sent
            for r, _ in admitted
            if r.client_request_id in recs
        )
        same_window = int(time.time() // 3600) == window
        used_client = prompt_total * p_in + delivered * p_out
        used_upstream = prompt_total * p_in + upstream * p_out
        # lazy: the hard cap is 2N uncharged tokens per stream (the meter holds events there);
        # typically about N, plus what flows while a charge is in flight
        bound = 0 if mode.endswith("strict") else 2 * b.plan.every * conc * p_out
        over_client = used_client - limit
        over_upstream = used_upstream - limit
        cut = [r for r, _ in admitted if r.cut]
        for r in cut:
            rec = recs.get(r.client_request_id)
            if rec and rec.disconnected_at and r.cut_wall:
                stops.append((rec.disconnected_at - r.cut_wall) * MS)
                if rec.last_token_at:
                    gaps.append((rec.disconnected_at - rec.last_token_at) * MS)
        raw[mode] = {
            "limit": limit,
            "requests": len(results),
            "admitted": len(admitted),
            "refused": sum(1 for r, _ in results if r.status == 429),
            "failed": sum(1 for r, _ in results if r.status not in (200, 429)),
            "cut": len(cut),
            "incomplete": sum(1 for r, _ in admitted if not r.done),
            "prompt_tokens": prompt_total,
            "delivered_client": delivered,
            "sent_upstream": upstream,
            "used_client": used_client,
            "used_upstream": used_upstream,
            "overshoot_client": over_client,
            "overshoot_upstream": over_upstream,
            "bound": bound,
            "utilisation": used_client / limit,
            "elapsed_s": elapsed,
            "same_window": same_window,
            "endings": dict(Counter(x.ending for x in recs.values())),
        }
        # Both modes are judged on what reached clients (what the counters charge); the
        # upstream figure also counts tokens generated after the cut and never delivered.
        over = over_client
        unit = "µUSD" if money else "tokens"
        row = b.table.add(
            Row(
                "5 accuracy",
                f"{mode}: overshoot ({conc} streams, N={b.plan.every})",
                unit,
                float(over),
                goal=Target("value", "<=", bound, unit),
                note=f"upstream {over_upstream:+d}, client {over_client:+d}",
            )
        )
        row.met = bool(row.met) and same_window
        b.table.add(
            Row(
                "5 accuracy",
                f"{mode}: utilisation (delivered+prompt)/limit",
                "%",
                100.0 * used_client / limit,
                goal=Target("value", ">=", 99, "%") if mode.endswith("strict") else None,
            )
        )
    raw["window_boundary"] = await window_boundary(b, stack)
    b.raw["accuracy"] = raw
    b.raw["stop_latency"] = {"cut_to_disconnect_ms": stops, "last_token_to_disconnect_ms": gaps}
    for name, xs in (
        ("client error event -> upstream disconnect", stops),
        ("upstream last token -> disconnect", gaps),
    ):
        for q in (50, 99):
            row = b.table.add(
                Row(
                    "6 stop",
                    f"{name} p{q} (n={len(xs)})",
                    "ms",
                    percentile(xs, q),
                    goal=Target("value", "<", 50, "ms"),
                )
            )


async def window_boundary(b: Bench, stack: Stack) -> dict[str, Any]:
    """Requests admitted in the worst one-second span across a window boundary, fixed versus
    sliding windows (limit ``BOUNDARY_RPS`` per second), with demand far above the limit in
    the half second on each side of the boundary."""
    limit = system.BOUNDARY_RPS
    out: dict[str, Any] = {}
    shape = Shape(prompt_tokens=10, max_tokens=1)
    for kind in ("fixed", "sliding"):
        # start 0.5 s before a whole second (window boundary), send for one second
        await asyncio.sleep(1.5 - time.time() % 1.0)
        end = time.time() + 1.0
        admitted: list[float] = []
        async with aiohttp.ClientSession(connector=connector(16)) as session:

            async def worker(
                i: int, kind: str = kind, admitted: list[float] = admitted, end: float = end
            ) -> None:
                url = f"http://127.0.0.1:{stack.envoy_ports[i % 2]}/v1"
                while time.time() < end:
                    sent = time.time()
                    r = await send(session, url, f"sk-{kind}", shape, limit_s=5)
                    if r.status == 200:
                        admitted.append(sent)

            await asyncio.gather(*(worker(i) for i in range(16)))
        admitted.sort()
        worst = max(
            (sum(1 for t in admitted[i:] if t - start < 1.0) for i, start in enumerate(admitted)),
            default=0,
        )
        out[kind] = {"admitted": len(admitted), "worst_1s": worst, "limit": limit}
        b.table.add(
            Row(
                "5 accuracy",
                f"{kind} window: most admitted in any 1 s across a boundary (limit {limit}/s)",
                "x limit",
                worst / limit,
                goal=Target("value", "<=", 1.6) if kind == "sliding" else None,
                note=f"{worst} of {len(admitted)} admitted",
            )
        )
    return out


async def measure(b: Bench, stacks: Stacks) -> None:
    """Start the accuracy stack (2 Envoys x 2 processors, one Redis), measure, stop it."""
    b.log("starting the accuracy stack (2 Envoys x 2 processors)")
    acc = await stacks.start("accuracy", envoys=2, extprocs=2)
    await accuracy(b, acc)
    acc.stop()


SCENARIO = Scenario("accuracy", measure)


def _billed_prompt(r: Result, counted: int, rec: SimRecord | None) -> int:
    """The prompt tokens a request is billed: the simulator's figure for a stream that ended
    with its usage (not cut), the gateway's own count otherwise."""
    if r.cut or not r.done or rec is None or not rec.prompt_tokens:
        return counted
    return rec.prompt_tokens
