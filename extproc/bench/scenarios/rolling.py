"""Section ``rolling``: failed requests while one of two processor replicas is drained or
killed and restarted under load (the measurement is :func:`extproc.bench.rolling.bench_section`)."""

from __future__ import annotations

from extproc.bench import rolling
from extproc.bench.drivers import KEY
from extproc.bench.plan import Bench
from extproc.bench.scenarios.base import Scenario, Stacks


async def measure(b: Bench, stacks: Stacks) -> None:
    """Start the rolling-restart stack (1 Envoy x 2 processors), measure, stop it."""
    b.log("starting the rolling-restart stack (1 Envoy x 2 processors)")
    roll = await stacks.start("rolling", extprocs=2)
    await rolling.bench_section(b, roll, KEY)
    roll.stop()


SCENARIO = Scenario("rolling", measure)
