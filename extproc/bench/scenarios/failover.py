"""Section ``failover``: Redis failovers under load, against the targets of docs/operations.md
"Redis HA": a Sentinel group's master SIGKILLed (3 Redis, 3 sentinels, down-after 1 s), a
Cluster primary SIGKILLed and a graceful ``CLUSTER FAILOVER`` (3 primaries, 3 replicas, node
timeout 2 s); for each, the time to recover, the calls that failed more than 2 s after the
promotion, and the tokens lost and doubled against ground truth (the drills are
:mod:`extproc.bench.failover`'s, the ones tests/faults/test_redis_ha_drills.py runs)."""

from __future__ import annotations

from typing import Any

from extproc.bench.failover import cluster_drill, sentinel_drill
from extproc.bench.ha_load import Report
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks

LABEL = "12 failover"


def _rows(b: Bench, name: str, report: Report) -> None:
    s = report.summary()
    t = b.table
    t.add(
        Row(
            LABEL,
            f"{name}: fault to promotion",
            "s",
            s["fault_to_promotion_s"],
            note="the detection window: Redis's own settings",
        )
    )
    t.add(
        Row(
            LABEL,
            f"{name}: fault to first success",
            "s",
            s["fault_to_first_success_s"],
            note="none failed" if s["fault_to_first_success_s"] is None else "",
        )
    )
    t.add(
        Row(
            LABEL,
            f"{name}: calls failed > 2 s after promotion",
            "calls",
            float(report.failed_after_promotion),
            goal=Target("value", "<=", 0, "calls"),
            note=f"{report.calls_failed} failed of {report.calls_ok + report.calls_failed}",
        )
    )
    for what in ("lost", "doubled"):
        t.add(
            Row(
                LABEL,
                f"{name}: tokens {what}",
                "tokens",
                float(s[what]),
                goal=Target("value", "<=", 0, "tokens"),
                note=f"of {report.truth} charged",
            )
        )


async def measure(b: Bench, stacks: Stacks) -> None:
    """Each drill starts and stops its own Redis processes."""
    raw: dict[str, Any] = {}
    workdir = b.workdir / "failover"
    b.log("failover: Sentinel group, master SIGKILLed under load")
    report, _, _ = await sentinel_drill(workdir / "sentinel", journal_s=10.0)
    raw["sentinel_sigkill"] = report.summary()
    _rows(b, "Sentinel SIGKILL", report)
    b.log("failover: Cluster, busy tenant's primary SIGKILLed under load")
    report, _ = await cluster_drill(workdir / "cluster-kill", graceful=False)
    raw["cluster_sigkill"] = report.summary()
    _rows(b, "Cluster SIGKILL", report)
    b.log("failover: Cluster, graceful CLUSTER FAILOVER under load")
    report, _ = await cluster_drill(workdir / "cluster-graceful", graceful=True)
    raw["cluster_graceful"] = report.summary()
    _rows(b, "Cluster graceful failover", report)
    b.raw["failover"] = raw


SCENARIO = Scenario("failover", measure)
