"""Section ``failover``: Redis failovers on the path users take, against the targets of
docs/operations.md "Redis HA": 12 closed-loop clients (70 % streams) and a prober through a
real Envoy and the processor (:mod:`extproc.bench.failover_drill`, the drills
tests/faults/test_failover_real_path.py runs): a Sentinel group's master SIGKILLed and frozen
(SIGSTOP until a replica is promoted, then SIGCONT), a Cluster primary SIGKILLed (each after the
replicas' links were cut for 0.3 s, so the master holds acknowledged writes no replica has),
a Cluster graceful failover (``CLUSTER FAILOVER`` to the primary's replica), a single Redis
SIGKILLed and restarted from its AOF (``appendfsync everysec``), and the Sentinel kill with the
tenant's streams strict against a limit it reaches during the run (0 tokens over it).  For each:
requests failed, streams cut, probes failed, the time to promotion (or restart), the p99 added
to non-streams in the window, tokens lost and doubled against the simulator's own records.
No request is ever sent again by the driver."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extproc.bench.failover_drill import (
    STRICT_TPM,
    DrillReport,
    cluster_kill_drill,
    restart_drill,
    sentinel_kill_drill,
)
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target
from extproc.bench.scenarios.base import Scenario, Stacks

LABEL = "12 failover"


def _rows(b: Bench, name: str, report: DrillReport) -> None:
    s = report.summary()
    t = b.table
    t.add(
        Row(
            LABEL,
            f"{name}: fault to promotion (or restart)",
            "s",
            s["fault_to_promotion_s"],
            note="the detection window: Redis's own settings",
        )
    )
    for what, value, of in (
        ("requests failed", report.failed, f"of {report.requests}, probes included"),
        ("streams cut", report.cut_streams, ""),
        ("probes failed", report.probes_failed, f"of {report.probes}"),
    ):
        t.add(
            Row(
                LABEL,
                f"{name}: {what}",
                "requests",
                float(value),
                goal=Target("value", "<=", 0, "requests"),
                note=of,
            )
        )
    t.add(
        Row(
            LABEL,
            f"{name}: added p99 beyond the promotion time",
            "s",
            round(report.added_p99_s - report.fault_to_promotion_s, 2),
            goal=Target("value", "<=", 0.5, "s"),
            note=f"added p99 {s['added_p99_s']} s (non-streams started in the window)",
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
                note=f"of {report.truth} by the simulator's records",
            )
        )


async def measure(b: Bench, stacks: Stacks) -> None:
    """Each drill starts and stops its own Redis processes, Envoy, processor and simulator."""
    raw: dict[str, Any] = {}
    workdir = b.workdir / "failover"
    drills: list[tuple[str, str, Callable[[Path], DrillReport]]] = [
        ("sentinel_sigkill", "Sentinel SIGKILL", sentinel_kill_drill),
        (
            "sentinel_freeze",
            "Sentinel frozen master",
            lambda p: sentinel_kill_drill(p, fault="freeze"),
        ),
        ("cluster_sigkill", "Cluster SIGKILL", cluster_kill_drill),
        (
            "cluster_graceful",
            "Cluster CLUSTER FAILOVER",
            lambda p: cluster_kill_drill(p, fault="failover"),
        ),
        ("aof_restart", "AOF restart (everysec)", restart_drill),
    ]
    for key, name, drill in drills:
        b.log(f"failover: {name}, through Envoy under load")
        report = await asyncio.to_thread(drill, workdir / key)
        raw[key] = report.summary()
        _rows(b, name, report)
    name = "Sentinel SIGKILL, strict streams at a limit"
    b.log(f"failover: {name}, through Envoy under load")
    report = await asyncio.to_thread(
        sentinel_kill_drill, workdir / "sentinel_strict", strict=True, tpm=STRICT_TPM
    )
    raw["sentinel_strict"] = report.summary()
    _strict_rows(b, name, report)
    b.raw["failover"] = raw


def _strict_rows(b: Bench, name: str, report: DrillReport) -> None:
    """The strict drill: refusals and cuts at the limit are expected; over the limit, cuts
    for ``quota_backend_unavailable``, failed probes and lost or doubled tokens are not."""
    s = report.summary()
    t = b.table
    t.add(
        Row(
            LABEL,
            f"{name}: fault to promotion",
            "s",
            s["fault_to_promotion_s"],
            note=f"limit {s['limit']} tokens reached {s['exhausted_after_fault_s']} s after "
            f"the fault; {s['refused']} refused (429), {s['cut_at_limit']} streams cut at it",
        )
    )
    t.add(
        Row(
            LABEL,
            f"{name}: tokens over the limit, every token the simulator sent",
            "tokens",
            float(s["over_upstream"]),
            note=f"an upper bound: includes {s['held_back']} tokens the gateway held back at "
            "the cuts (never delivered)",
        )
    )
    for what, value, unit, note in (
        (
            "tokens over the limit, as delivered",
            s["over_client"],
            "tokens",
            f"{s['used_client']} delivered: complete answers by the simulator's records, cut "
            "streams as their clients received them",
        ),
        (
            "requests failed, not refused at the limit",
            report.failed - s["refused"],
            "requests",
            f"{s['refused']} refused (429) at the limit",
        ),
        ("streams cut for quota_backend_unavailable", s["cut_backend"], "requests", ""),
        ("probes failed", s["probes_failed"], "requests", f"of {s['probes']}"),
        ("tokens lost", s["lost"], "tokens", f"of {s['truth_tokens']}"),
        ("tokens doubled", s["doubled"], "tokens", f"of {s['truth_tokens']}"),
    ):
        t.add(
            Row(
                LABEL,
                f"{name}: {what}",
                unit,
                float(value),
                goal=Target("value", "<=", 0, unit),
                note=note,
            )
        )


SCENARIO = Scenario("failover", measure)
