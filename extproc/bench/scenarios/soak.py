"""Section ``soak``: memory, key count and failures over a long mixed load (the measurement is
:func:`extproc.bench.soak.bench_section`)."""

from __future__ import annotations

from extproc.bench import soak
from extproc.bench.plan import Bench
from extproc.bench.scenarios.base import Scenario, Stacks


async def measure(b: Bench, stacks: Stacks) -> None:
    """Start the soak stack (1 Envoy x 1 processor), measure, stop it."""
    b.log("starting the soak stack (1 Envoy x 1 processor)")
    st = await stacks.start(
        "soak",
        # ground truth for every request (about 350 a second on two cores)
        sim_max_records=int(b.plan.soak_seconds * 600) + 10_000,
    )
    await soak.bench_section(b, st, b.plan.soak_seconds)
    st.stop()


SCENARIO = Scenario("soak", measure)
