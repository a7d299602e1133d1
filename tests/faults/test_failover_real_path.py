"""Redis failover drills on the path users take (issue 32): 12 closed-loop clients (70 %
streams, 10 ms between tokens) and a prober, through a real Envoy and the processor, on a real
Sentinel group (3 redis-server, 3 sentinels, down-after 1 s) or Cluster (3 primaries + 3
replicas, node timeout 2 s); the replicas' links cut 0.3 s before the primary is SIGKILLed, so
it dies holding acknowledged writes no replica has.  No request is ever sent again by the
driver.  Truth is the simulator's own records (prompt tokens plus the tokens it sent, for 2xx
answers), compared with the tenant's TPM counter on the new primary once every ledger is
settled (extproc/bench/failover_drill.py, also ``scripts/bench --only failover``).  Also: the
master frozen instead of killed, a Cluster graceful failover (``CLUSTER FAILOVER``), strict
streams against a limit through a Sentinel kill (0 over), the processor SIGKILLed during the
failover (a bound), and a single Redis restarted from its AOF."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from extproc.bench.failover_drill import (
    STRICT_TPM,
    DrillReport,
    cluster_kill_drill,
    restart_drill,
    sentinel_kill_drill,
)
from extproc.stack import Stack

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


def test_cluster_graceful_failover_fails_nothing_and_bills_the_upstreams_records(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """``CLUSTER FAILOVER`` sent to the replica of the tenant's slot's primary under the same
    load (a planned switch: the replica takes over once it has every write; the old primary
    becomes its replica and answers MOVED): 0 failed, 0 cut, 0 lost, 0 doubled; the added p99
    is reported and held to the same target as a kill (promotion + 0.5 s)."""
    report = cluster_kill_drill(tmp_path, fault="failover")
    s = _check(report, record_property)
    assert (report.failed, report.cut_streams, report.probes_failed) == (0, 0, 0), s
    assert (report.lost, report.doubled) == (0, 0), s
    assert report.added_p99_s <= report.fault_to_promotion_s + 0.5, s


def test_strict_streams_through_a_sentinel_failover_never_go_over_the_limit(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Issue 32's target "strict mode through a failover: 0 over the limit": the busy tenant's
    streams strict (``charging.streaming: strict``) against a limit of 10,000 tokens a day it
    exhausts during the run, the Sentinel master SIGKILLed (replicas' links cut 0.3 s before)
    while they run.  Each request is matched with the simulator's record of it.  Delivered, as
    billed: a complete answer's prompt and output by the simulator's records, a cut stream's
    output as its client received it and its prompt at the gateway's count (the upstream's
    usage never came): over the limit <= 0, and the counter equals it (0 lost, 0 doubled).
    Reported, not asserted: the same with every token the simulator sent (``over_upstream``),
    which also counts what it generated past the cut that the gateway held back
    (``held_back``).  Requests refused at the limit (429) and streams cut at it are expected;
    none may fail or be cut for ``quota_backend_unavailable``, every probe (another tenant)
    answers 200.  Measured (docs/operations.md "Redis HA"): 0 over in 44 of 44 runs; two runs
    failed this test, one on 1 token "lost" (cause not found) and one on the added p99 (the
    Sentinel failover's end, not its promotion, let the processor switch)."""
    report = sentinel_kill_drill(tmp_path, strict=True, tpm=STRICT_TPM)
    s = _check(report, record_property)
    assert report.notes["refused"] > 0, s  # the limit was reached during the run
    assert report.notes["over_client"] <= 0, s
    assert (report.lost, report.doubled) == (0, 0), s
    assert report.notes["cut_backend"] == 0 and report.probes_failed == 0, s
    assert report.added_p99_s <= report.fault_to_promotion_s + 0.5, s
    # every failure a refusal at the limit, every cut a cut at the limit
    assert set(report.errors) <= {"429:tpm_limit_exceeded", "200:tpm_limit_exceeded"}, s


def test_sentinel_frozen_master_loses_nothing(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The master SIGSTOPped until a replica is promoted, then SIGCONTed: calls the new
    master got before the journal's replay of the same requests (a charge, a settlement
    before the lost admission) do not make the replay a no-op (each admission, charge and
    settlement applies once, in any order: tests/integration/test_replay_order.py), and the
    run-id check asks the master the sentinels name, not whatever old connection answers."""
    report = sentinel_kill_drill(tmp_path, fault="freeze")
    s = _check(report, record_property)
    assert (report.failed, report.cut_streams) == (0, 0), s
    assert (report.lost, report.doubled) == (0, 0), s


def _tokens_in(records: list[dict[str, Any]], start: float, end: float) -> float:
    """The tokens the tenant's 2xx requests used in [start, end] (unix s): the prompt of each
    request started then, and of each answer's output the share sent then (evenly spread
    between its first and last token)."""
    total = 0.0
    for r in records:
        if not 200 <= (r["status"] or 0) < 300:
            continue
        if start <= r["started_at"] <= end:
            total += r["prompt_tokens"]
        first, last = r["first_token_at"], r["last_token_at"]
        if first is None or last is None or not r["tokens_sent"]:
            continue
        if last <= first:
            total += r["tokens_sent"] if start <= first <= end else 0
            continue
        overlap = max(0.0, min(end, last) - max(start, first))
        total += r["tokens_sent"] * overlap / (last - first)
    return total


#: What a processor SIGKILLed with requests in flight may leave wrong by itself (its streams'
#: last charges and its reclaimed reservations: tests/faults/test_processor_kill.py).
PROCESSOR_KILL_BOUND = 150


def test_sentinel_master_then_processor_sigkill_loses_at_most_what_it_held(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Issue 32 item 3: the processor SIGKILLed 1 s after the master (before the promotion),
    then started again.  What it held in memory dies with it: its journal (what the dead master
    acknowledged and no replica got: here while the replicas' links were cut, 0.24 s before
    the master's kill; in production the replication lag, usually milliseconds) and the stream
    charges waiting for Redis (a lazy stream keeps delivering while its charge waits).  Bound:
    |counter - truth| <= the tokens the tenant used from the cut until the processor died
    (+ 50 ms either side) + what a processor crash may leave by itself (150, the streams' last
    charges: tests/faults/test_processor_kill.py).  Requests in flight in the killed processor
    fail (Envoy answers 503, streams break): reported, not asserted."""
    killed: list[float] = []

    def kill_processor(stack: Stack, group: object, old: int) -> None:
        time.sleep(1.0)
        stack.signal("extproc0", signal.SIGKILL)
        killed.append(time.time())
        stack.proc("extproc0").popen.wait(10)
        stack.restart("extproc0")

    report = sentinel_kill_drill(tmp_path, during=kill_processor, lease_s=3, after_s=6.0)
    s = report.summary()
    dump = json.loads((tmp_path / "dump.json").read_text())
    held = _tokens_in(dump["records"], s["cut_wall"] - 0.05, killed[0] + 0.05)
    gap = _tokens_in(dump["records"], s["cut_wall"] - 0.05, s["fault_wall"] + 0.05)
    s["held_tokens"], s["gap_tokens"] = round(held), round(gap)
    record_property("sentinel_kill_processor_kill", json.dumps(s))
    print(f"\nsentinel kill + processor kill: {json.dumps(s)}")
    assert report.requests > 100, s
    assert abs(report.counter - report.truth) <= held + PROCESSOR_KILL_BOUND, s


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_redis_restart_from_aof_fails_nothing_and_bills_the_upstreams_records(
    tmp_path: Path, fsync: str, record_property: Callable[[str, object], None]
) -> None:
    """One Redis, appendonly yes, SIGKILLed under the load and started again from its AOF
    0.5 s later: a pause, not an error; the counter equals the simulator's records (a
    SIGKILL leaves the AOF's last second in the page cache; what a power loss would take with
    ``everysec`` is what the journal replays to the restarted server: a new run id)."""
    report = restart_drill(tmp_path, fsync=fsync)
    s = _check(report, record_property)
    assert (report.failed, report.cut_streams, report.probes_failed) == (0, 0, 0), s
    assert (report.lost, report.doubled) == (0, 0), s
