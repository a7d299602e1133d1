"""Section ``non_streams``: what the exact path costs.  A non-streaming request on the exact
path goes upstream as a stream with usage, is metered event by event (one ext_proc message
per SSE chunk) and its JSON rebuilt for the client; on the JSON path (``non_streams: json``)
it is forwarded as sent and its one JSON body read for its usage.  One stack, one processor,
two models on the same simulator (``sim-small`` exact, ``sim-json`` JSON); per output length
the two arms alternate (A B A B, ``rounds`` times), each a batch of non-streaming requests
at concurrency 4; the processor tree's CPU per request, the per-round exact / JSON ratio and
the ext_proc messages Envoy sent per request.  A third arm, ``sim-exact16``, is the exact path
asking the engine for :data:`INTERVAL` tokens per chunk (``exact_stream_interval``: vLLM's
``stream_interval``, which the simulator follows: the first token alone, then that many per
chunk).  The exact path is the default when it costs at most :data:`EXACT_CPU_RATIO`
(docs/performance.md)."""

from __future__ import annotations

import asyncio
import copy
from functools import partial
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, US, batch, interleave, med_rounds, ok_count
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stats import median

#: (output tokens, ms between tokens) measured: the simulator sends one token per chunk; at
#: ITL 0 Envoy often reads several chunks at once, paced (as an engine decodes) one each.
OUTPUTS: tuple[tuple[int, float], ...] = ((8, 0.0), (64, 0.0), (256, 0.0), (64, 2.0))
#: The prompt of every request.
PROMPT_TOKENS = 200
#: The exact path is the default when it costs at most this much CPU per non-stream.
EXACT_CPU_RATIO = 1.10
SETTLE_S = 0.15
#: The third arm's ``exact_stream_interval``.
INTERVAL = 16
#: The arms: name -> (model, what its rows call it).
ARMS = {
    "exact": ("sim-small", "exact path"),
    "exact16": ("sim-exact16", f"exact path, exact_stream_interval {INTERVAL}"),
    "json": ("sim-json", "JSON path"),
}


def rules_with_json_model(rules: dict[str, Any]) -> dict[str, Any]:
    """The run's rules with ``sim-small`` on the exact path, plus the same model as
    ``sim-json`` on the JSON path and as ``sim-exact16`` on the exact path with
    ``exact_stream_interval``."""
    out = copy.deepcopy(rules)
    model = copy.deepcopy(out["models"]["sim-small"])
    model.pop("aliases", None)
    out["models"]["sim-json"] = {**model, "non_streams": "json"}
    out["models"]["sim-exact16"] = {
        **model,
        "non_streams": "exact",
        "exact_stream_interval": INTERVAL,
    }
    out["models"]["sim-small"]["non_streams"] = "exact"
    return out


async def measure(b: Bench, stacks: Stacks) -> None:
    """Both arms on one stack, alternated per output length."""
    stack = await asyncio.to_thread(
        system.start_stack,
        stacks.workdir / "non_streams",
        rules_with_json_model(stacks.rules),
        sim_models=tuple(model for model, _ in ARMS.values()),
    )
    stacks.started.append(stack)
    meter = system.CpuMeter(system.proc_pids(stack, "extproc"))
    n, c = b.plan.fixed_requests, b.plan.fixed_concurrency
    raw: dict[str, Any] = b.raw.setdefault("non_streams", {})
    for model, _ in ARMS.values():  # warm every path
        warm = Shape(PROMPT_TOKENS, 8, model=model)
        await batch(stack.base_url, KEY, warm, count=30, concurrency=c)

    async def one_round(shape: Shape) -> dict[str, float]:
        before = system.envoy_counters(stack.ports.envoy_admin)
        meter.start()
        rs = await batch(stack.base_url, KEY, shape, count=n, concurrency=c)
        await asyncio.sleep(SETTLE_S)
        cpu = meter.stop()
        after = system.envoy_counters(stack.ports.envoy_admin)
        sent = sum(after[k] - before.get(k, 0) for k in after if k.endswith("stream_msgs_sent"))
        done = max(1, len(rs))
        return {
            "requests": float(len(rs)),
            "errors": float(len(rs) - ok_count(rs)),
            "cpu_per_req_us": cpu / done * US,
            "msgs_per_req": sent / done,
        }

    for out, itl in OUTPUTS:
        what = f"{out} output tokens" + (f" {itl:g} ms apart" if itl else "")
        b.log(f"non_streams: {what}, {n} requests at c={c} per arm x {b.plan.rounds}")
        arms = {
            name: partial(one_round, Shape(PROMPT_TOKENS, out, itl_ms=itl, model=model))
            for name, (model, _) in ARMS.items()
        }
        rounds = await interleave(b.plan.rounds, arms)
        med = {a: {k: med_rounds([r[k] for r in rs]) for k in rs[0]} for a, rs in rounds.items()}
        ratios = {
            arm: [
                e["cpu_per_req_us"] / j["cpu_per_req_us"]
                for e, j in zip(rounds[arm], rounds["json"], strict=True)
                if j["cpu_per_req_us"] > 0
            ]
            for arm in ARMS
            if arm != "json"
        }
        errors = {a: int(sum(r["errors"] for r in rs)) for a, rs in rounds.items()}
        raw[f"out{out}" + (f"_itl{itl:g}" if itl else "")] = {
            "rounds": rounds,
            "median": med,
            "ratios": ratios,
            "errors": errors,
        }
        failed = "failed: " + ", ".join(f"{a} {n}" for a, n in errors.items())
        for arm, arm_ratios in ratios.items():
            spread = (
                f"ratio per round: median {median(arm_ratios):.2f}x, "
                f"{min(arm_ratios):.2f}-{max(arm_ratios):.2f}x"
                if arm_ratios
                else ""
            )
            label = ARMS[arm][1]
            b.table.add(
                Row(
                    "13 non_streams",
                    f"processor CPU per non-stream, {label}, {what} (base = JSON path)",
                    "µs",
                    med[arm]["cpu_per_req_us"],
                    med["json"]["cpu_per_req_us"],
                    goal=Target("ratio", "<=", EXACT_CPU_RATIO),
                    note=", ".join(
                        x for x in (spread, failed if any(errors.values()) else "") if x
                    ),
                )
            )
            b.table.add(
                Row(
                    "13 non_streams",
                    f"gRPC messages Envoy sent per non-stream, {label}, {what} (base = JSON path)",
                    "msgs",
                    med[arm]["msgs_per_req"],
                    med["json"]["msgs_per_req"],
                )
            )


SCENARIO = Scenario("non_streams", measure)
