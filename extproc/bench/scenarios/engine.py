"""Section ``engine``: the gateway's bills against a real engine's own count (vLLM's CPU build
on a tiny local model; the measurement is :func:`extproc.bench.engine.bench_section`). Skipped
with a note when ``.venv-engine`` is not installed (``scripts/setup --engine``)."""

from __future__ import annotations

from extproc.bench import engine
from extproc.bench.plan import Bench
from extproc.bench.scenarios.base import Scenario, Stacks


async def measure(b: Bench, stacks: Stacks) -> None:
    """Start the engine and a gateway in front of it (its own stacks), measure, stop them."""
    await engine.bench_section(b)


SCENARIO = Scenario("engine", measure)
