"""A benchmark run: start the main stack the chosen ``on_main`` scenarios share, run them, stop
it, then run the scenarios that start their own stacks; stop everything at the end.

Each scenario (one module under :mod:`extproc.bench.scenarios`) compares the gateway with a
baseline measured in the same run, alternating the two (A B A B ...) for several rounds and
keeping the medians.  Stacks are on free loopback ports, started with :mod:`extproc.stack`:

* ``main``: Redis, simulator, one real processor, one Envoy with the filtered listener and a
  baseline listener without the filter (the same Envoy);
* ``floor``: simulator, the do-nothing processor (:mod:`extproc.bench.floor`), one Envoy
  (started by the first ``on_main`` scenario that compares with it, stopped with ``main``);
* ``accuracy``: 2 Envoys x 2 processor replicas, one Redis;
* ``workers``: one Envoy each in front of ``serve --workers 1``, ``--workers 2`` and
  ``--workers 1`` on the asyncio loop.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, batch
from extproc.bench.plan import Bench
from extproc.bench.scenarios import SCENARIOS
from extproc.bench.scenarios.base import Stacks


async def run(b: Bench) -> None:
    """Start the stacks the chosen sections need, measure, stop everything."""
    rules = system.bench_rules(every=b.plan.every, tpm_limit=b.plan.acc_limit)
    chosen = [s for s in SCENARIOS if s.name in b.sections]
    stacks = Stacks(workdir=b.workdir, rules=rules)
    try:
        on_main = [s for s in chosen if s.on_main]
        if on_main:
            b.log("starting the main stack (Envoy with baseline listener)")
            main = stacks.main = await stacks.start("main", baseline=True)
            await batch(main.base_url, KEY, Shape(), count=30, concurrency=4)
            await batch(stacks.baseline_url, KEY, Shape(), count=30, concurrency=4)
            for scenario in on_main:
                await scenario.measure(b, stacks)
            stacks.stop_shared()
        for scenario in chosen:
            if not scenario.on_main:
                await scenario.measure(b, stacks)
    finally:
        stacks.stop_all()


def new_workdir() -> Path:
    """A scratch directory for the stacks' logs and configs."""
    return Path(tempfile.mkdtemp(prefix="aiq-bench-"))
