"""Section ``rls``: Envoy's global rate limit filter calling ai-quota's RLS API against the same
Envoy without it (the measurement is :func:`extproc.bench.rls.bench_section`)."""

from __future__ import annotations

from extproc.bench import rls
from extproc.bench.plan import Bench
from extproc.bench.scenarios.base import Scenario, Stacks


async def measure(b: Bench, stacks: Stacks) -> None:
    """Its own stack and Envoy, stopped on return."""
    await rls.bench_section(b, stacks)


SCENARIO = Scenario("rls", measure)
