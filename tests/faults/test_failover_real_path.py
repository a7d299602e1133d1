"""Redis failover drills on the path users take (issue 32): 12 closed-loop clients (70 %
streams, 10 ms between tokens) and a prober, through a real Envoy and the processor, on a real
Sentinel group (3 redis-server, 3 sentinels, down-after 1 s) or Cluster (3 primaries + 3
replicas, node timeout 2 s); the replicas' links cut 0.3 s before the primary is SIGKILLed, so
it dies holding acknowledged writes no replica has.  No request is ever sent again by the
driver.  Truth is the simulator's own records (prompt tokens plus the tokens it sent, for 2xx
answers), compared with the tenant's TPM counter on the new primary once every ledger is
settled (extproc/bench/failover_drill.py, also ``scripts/bench --only failover``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from extproc.bench.failover_drill import DrillReport, cluster_kill_drill, sentinel_kill_drill

pytestmark = pytest.mark.faults


def _check(report: DrillReport, record: Callable[[str, object], None]) -> dict[str, object]:
    s = report.summary()
    record(f"{report.topology}_{report.fault}", json.dumps(s))
    print(f"\n{report.topology} {report.fault}: {json.dumps(s)}")  # the figures, with -s
    assert report.requests > 100 and report.probes > 30, s
    assert report.notes["ledgers"] == report.notes["records"], s  # every request settled
    return s


def test_sentinel_master_sigkill_fails_nothing_and_bills_the_upstreams_records(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Clients see a pause, not an error: 0 failed requests, 0 cut streams, every probe 200;
    the counter on the promoted replica equals the simulator's records (the journal gave back
    what the dead master acknowledged); added p99 within the promotion time + 0.5 s."""
    report = sentinel_kill_drill(tmp_path)
    s = _check(report, record_property)
    assert (report.failed, report.cut_streams, report.probes_failed) == (0, 0, 0), s
    assert (report.lost, report.doubled) == (0, 0), s
    assert report.notes["replayed"] > 0, s  # the journal was needed, and replayed
    assert report.added_p99_s <= report.fault_to_promotion_s + 0.5, s


def test_cluster_primary_sigkill_fails_nothing_and_bills_the_upstreams_records(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The same on a Cluster, the primary of the tenant's slot killed."""
    report = cluster_kill_drill(tmp_path)
    s = _check(report, record_property)
    assert (report.failed, report.cut_streams, report.probes_failed) == (0, 0, 0), s
    assert (report.lost, report.doubled) == (0, 0), s
    assert report.added_p99_s <= report.fault_to_promotion_s + 0.5, s


@pytest.mark.xfail(
    strict=True,
    reason="issue 32 item 4, open: a frozen master that runs again answers the processor's "
    "run-id check with its old run id while new connections already reach the promoted "
    "replica; charges land there before the journal's admissions are replayed, and a replayed "
    "admission finds its ledger and charges nothing (measured 330-758 tokens lost in 4 runs)",
)
def test_sentinel_frozen_master_loses_nothing(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The master SIGSTOPped until a replica is promoted, then SIGCONTed."""
    report = sentinel_kill_drill(tmp_path, fault="freeze")
    s = _check(report, record_property)
    assert (report.failed, report.cut_streams) == (0, 0), s
    assert (report.lost, report.doubled) == (0, 0), s
