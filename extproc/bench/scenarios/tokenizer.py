"""Section 4, tokenizer: the in-process cost of counting a prompt, and end-to-end latency at a
32k-token prompt versus a 1k-token one."""

from __future__ import annotations

import time

import orjson

from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, US, batch, interleave, med_rounds, pct_ms
from extproc.bench.plan import Bench
from extproc.bench.report import Row
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack
from extproc.stats import median


def tokenizer_inprocess(b: Bench) -> dict[str, float]:
    """Median time of ``count_chat_request`` with the cl100k counter at 1k and 32k tokens."""
    from extproc.core.apis.openai.counting import count_chat_request
    from extproc.core.tokens import TokenizerSpec
    from extproc.tokenizers.registry import load_counter

    spec = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")
    counter = load_counter(spec)
    out: dict[str, float] = {}
    for tokens, reps in ((1000, 200), (32000, 10)):
        body = orjson.loads(Shape(prompt_tokens=tokens).body(1))
        count_chat_request(body, counter, spec)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                count_chat_request(body, counter, spec)
            samples.append((time.perf_counter() - t0) / reps)
        out[f"count_{tokens}_us"] = (median(samples) or 0.0) * US
        out[f"tokens_{tokens}"] = float(count_chat_request(body, counter, spec))
    return out


async def tokenizer(b: Bench, main: Stack, baseline_url: str) -> None:
    """In-process counting cost, and end-to-end latency at 32k vs 1k prompt tokens."""
    inproc = tokenizer_inprocess(b)
    b.table.add(
        Row("4 tokenizer", "count_chat_request, 1k-token prompt", "µs", inproc["count_1000_us"])
    )
    b.table.add(
        Row("4 tokenizer", "count_chat_request, 32k-token prompt", "µs", inproc["count_32000_us"])
    )
    n = b.plan.tok_e2e
    b.log(f"tokenizer end to end: {n} requests of 1k and 32k per arm x {b.plan.rounds}")
    small, big = Shape(prompt_tokens=1000, max_tokens=8), Shape(prompt_tokens=32000, max_tokens=8)
    res = await interleave(
        b.plan.rounds,
        {
            "baseline_1k": lambda: batch(baseline_url, KEY, small, count=n, concurrency=1),
            "gateway_1k": lambda: batch(main.base_url, KEY, small, count=n, concurrency=1),
            "baseline_32k": lambda: batch(baseline_url, KEY, big, count=n, concurrency=1),
            "gateway_32k": lambda: batch(main.base_url, KEY, big, count=n, concurrency=1),
        },
    )
    p50 = {arm: med_rounds([pct_ms(r, 50) for r in rs]) for arm, rs in res.items()}
    b.raw["tokenizer"] = {"in_process": inproc, "p50_ms": p50}
    b.table.add(
        Row(
            "4 tokenizer",
            "latency p50, 32k-token prompt",
            "ms",
            p50["gateway_32k"],
            p50["baseline_32k"],
        )
    )

    def sub(a: float | None, c: float | None) -> float | None:
        return None if a is None or c is None else a - c

    b.table.add(
        Row(
            "4 tokenizer",
            "latency p50, 32k minus 1k prompt",
            "ms",
            sub(p50["gateway_32k"], p50["gateway_1k"]),
            sub(p50["baseline_32k"], p50["baseline_1k"]),
        )
    )


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack."""
    await tokenizer(b, stacks.shared, stacks.baseline_url)


SCENARIO = Scenario("tokenizer", measure, on_main=True)
