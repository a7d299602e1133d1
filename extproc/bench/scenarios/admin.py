"""Section ``admin``: how long a key created or revoked in the admin store takes to be in force
on every replica, against the 1 s bound of docs/admin.md (the measurement is
:func:`extproc.bench.propagation.bench_section`)."""

from __future__ import annotations

from extproc.bench import propagation
from extproc.bench.plan import Bench
from extproc.bench.scenarios.base import Scenario, Stacks


async def measure(b: Bench, stacks: Stacks) -> None:
    """Three replicas following one redis-server of the section's own."""
    b.log("measuring admin key propagation (3 replicas on one redis-server)")
    await propagation.bench_section(b, stacks.rules)


SCENARIO = Scenario("admin", measure)
