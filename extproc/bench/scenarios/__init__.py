"""The benchmark scenarios, one module each, registered in :data:`SCENARIOS`.

To add one: write a module with a ``SCENARIO = Scenario(name, measure, on_main=...)`` and list
it below.  The order here is the order of ``--only``/``--skip`` choices; the ``on_main``
scenarios run first (in this order, on one shared main stack), then the others.
"""

from __future__ import annotations

from extproc.bench.scenarios import (
    accuracy,
    admin,
    admission,
    door,
    engine,
    failover,
    levels,
    non_streams,
    peer,
    profile,
    rls,
    rolling,
    round_trips,
    scale,
    soak,
    streaming,
    telemetry,
    tokenizer,
    waiting,
    workers,
)
from extproc.bench.scenarios.base import Scenario

SCENARIOS: tuple[Scenario, ...] = (
    admission.SCENARIO,
    non_streams.SCENARIO,
    streaming.SCENARIO,
    round_trips.SCENARIO,
    tokenizer.SCENARIO,
    accuracy.SCENARIO,
    workers.SCENARIO,
    scale.SCENARIO,
    profile.SCENARIO,
    rolling.SCENARIO,
    soak.SCENARIO,
    rls.SCENARIO,
    door.SCENARIO,
    admin.SCENARIO,
    failover.SCENARIO,
    engine.SCENARIO,
    telemetry.SCENARIO,
    peer.SCENARIO,
    levels.SCENARIO,
    waiting.SCENARIO,
)

#: The section names, as ``--only`` and ``--skip`` take them.
SECTIONS: tuple[str, ...] = tuple(s.name for s in SCENARIOS)
