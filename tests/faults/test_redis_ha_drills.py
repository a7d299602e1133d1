"""Redis HA drills on real processes (loopback): a Sentinel group's master SIGKILLed under a mixed
streaming / non-streaming load (tests/ha_load.py), the replicas frozen just before so that the
master dies holding acknowledged writes no replica has (the asynchronous-replication loss);
Redis restarted under appendfsync everysec and always.  Each drill reports the time from the
fault to the first success, the calls that failed after the promotion, tokens lost and doubled
(the tenant's counter on the new master against the load's ground truth) and the errors seen
(NOSCRIPT, READONLY...).  Bounded: every drill well under a minute."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.breaker import BreakerSettings
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from tests.ha_load import Load, Report
from tests.ha_support import HaCluster, SentinelGroup, wait_ping
from tests.helpers import RedisServer

pytestmark = pytest.mark.faults

WARM_S = 1.5  # load before the fault
AFTER_S = 3.0  # load kept after the promotion


def _report(name: str, report: Report, record: Callable[[str, object], None]) -> dict[str, object]:
    summary = report.summary()
    record(name, json.dumps(summary))
    print(f"\n{name}: {json.dumps(summary)}")  # the drill's figures, shown with -s
    return summary


def _cut_off(master: int, key: str) -> None:
    """Wait until ``master`` has no replica attached, then until it has acknowledged more
    charges of ``key`` (at most 0.3 s): writes no replica has."""
    deadline = time.monotonic() + 0.3
    with redis.Redis(port=master, socket_timeout=1) as m:
        while int(m.info("replication")["connected_slaves"]) > 0:
            assert time.monotonic() < deadline, "the master still sees a replica"
            time.sleep(0.005)
        cut_at = int(m.get(key) or 0)
        while int(m.get(key) or 0) - cut_at < 500:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert int(m.get(key) or 0) > cut_at, "no charge acknowledged after the cut"


def _server_errors(report: Report, errorstats: dict[str, dict[str, int]]) -> None:
    """The new master's NOSCRIPT / READONLY / MOVED... counts (ERR is left out: redis-py's
    CLIENT SETINFO on each new connection, which Redis 7.0 does not know)."""
    for name, stat in errorstats.items():
        if name != "errorstat_ERR":
            report.errors[f"server:{name.removeprefix('errorstat_')}"] += int(stat["count"])


async def _sentinel_drill(tmp_path: Path, *, journal_s: float) -> tuple[Report, Metrics, int]:
    group = SentinelGroup(
        tmp_path / "sentinel",
        replicas=2,
        down_after_ms=1000,
        extra=["--enable-debug-command", "local"],
    )
    metrics = Metrics()
    lim = RedisLimiter.from_url(
        group.url(),
        timeout_ms=250,
        metrics=metrics,
        journal_s=journal_s,
        breaker=BreakerSettings(open_s=0.5),
    )
    load = Load(lim, "sentinel")
    try:
        old = group.ports[0]
        running = load.start(deadline_s=30.0)
        await asyncio.sleep(WARM_S)
        # the replicas drop their link and sleep 0.7 s: for 0.3 s the master acknowledges
        # writes that only it has, then it dies
        cuts = [group.cut_replication(p, 1.0) for p in group.ports if p != old]
        await asyncio.to_thread(_cut_off, old, load.key)
        load.report.fault_at = time.monotonic()
        group.kill(old)
        for cut in cuts:
            await asyncio.to_thread(cut.join, 5)
        new, promoted = await asyncio.to_thread(group.wait_new_master, old, 30.0)
        load.report.promoted_at = promoted
        await asyncio.sleep(AFTER_S)
        load.stop()
        await asyncio.wait_for(running, 30.0)
        with redis.Redis(port=new) as m:
            load.report.counter = int(m.get(load.key) or 0)
            errorstats = m.info("errorstats")
        _server_errors(load.report, errorstats)
        return load.report, metrics, new
    finally:
        load.stop()
        await lim.close()
        group.stop()


async def test_sentinel_master_sigkill_loses_and_doubles_nothing(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The master SIGKILLed with its replicas 0.4 s behind: the journal is replayed to the
    promoted replica, so the tenant's counter there equals the ground truth (0 lost, 0
    doubled), and no call started more than 2 s after the promotion fails."""
    report, metrics, _ = await _sentinel_drill(tmp_path, journal_s=10.0)
    s = _report("sentinel_sigkill", report, record_property)
    assert report.unfinished == 0, s
    assert (s["lost"], s["doubled"]) == (0, 0), s
    assert report.failed_after_promotion == 0, s
    assert report.first_success_after_fault is not None, s
    assert metrics.registry.get_sample_value("aiq_redis_failovers_total") == 1, s
    assert (metrics.registry.get_sample_value("aiq_journal_replays_total") or 0) >= 1, s


async def test_sentinel_without_journal_loses_charges(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The same drill with the journal off (AIQ_REDIS_JOURNAL_S=0) shows what it prevents:
    acknowledged charges the dead master held are gone from the new master."""
    report, _, _ = await _sentinel_drill(tmp_path, journal_s=0)
    s = _report("sentinel_sigkill_no_journal", report, record_property)
    assert s["doubled"] == 0, s
    assert report.lost > 0, s


@pytest.mark.parametrize("fsync", ["everysec", "always"])
async def test_restart_with_aof(
    tmp_path: Path, fsync: str, record_property: Callable[[str, object], None]
) -> None:
    """Redis with appendonly yes SIGKILLed under load and started again from its AOF: with
    ``everysec`` up to a second of acknowledged writes may be missing from the file, and the
    journal puts them back (a restarted server has a new run id); with ``always`` nothing is
    missing, and the replay changes nothing.  0 lost, 0 doubled either way."""
    extra = ["--appendonly", "yes", "--appendfsync", fsync]
    server = RedisServer(tmp_path / "redis", extra=extra)
    metrics = Metrics()
    lim = RedisLimiter.from_url(
        server.url, timeout_ms=250, metrics=metrics, breaker=BreakerSettings(open_s=0.5)
    )
    load = Load(lim, f"restart-{fsync}")
    try:
        running = load.start(deadline_s=20.0)
        await asyncio.sleep(WARM_S)
        load.report.fault_at = time.monotonic()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        await asyncio.sleep(0.5)
        restarted = RedisServer.__new__(RedisServer)
        restarted.port, restarted.workdir = server.port, server.workdir
        from tests.helpers import spawn

        restarted.proc = spawn(
            [
                "redis-server",
                "--port",
                str(server.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(server.workdir),
                *extra,
            ],
            server.workdir / "redis.log",
        )
        server = restarted
        await asyncio.to_thread(wait_ping, server.port, 20.0)
        load.report.promoted_at = time.monotonic()
        await asyncio.sleep(AFTER_S)
        load.stop()
        await asyncio.wait_for(running, 30.0)
        with redis.Redis(port=server.port) as m:
            load.report.counter = int(m.get(load.key) or 0)
        s = _report(f"restart_appendfsync_{fsync}", load.report, record_property)
        assert load.report.unfinished == 0, s
        assert (s["lost"], s["doubled"]) == (0, 0), s
        assert load.report.failed_after_promotion == 0, s
        assert metrics.registry.get_sample_value("aiq_redis_failovers_total") == 1, s
    finally:
        load.stop()
        await lim.close()
        server.stop()


async def test_script_flush_under_load(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """SCRIPT FLUSH five times under load (what a promoted replica looks like to EVALSHA: it
    never got SCRIPT LOAD): every call gets NOSCRIPT at most once and redis-py reloads the
    script; no call fails, nothing is lost or doubled."""
    server = RedisServer(tmp_path / "redis")
    lim = RedisLimiter.from_url(server.url, timeout_ms=250)
    load = Load(lim, "flush")
    try:
        running = load.start(deadline_s=20.0)
        with redis.Redis(port=server.port) as admin:
            for _ in range(5):
                await asyncio.sleep(0.3)
                admin.script_flush()
            await asyncio.sleep(0.3)
            load.stop()
            await asyncio.wait_for(running, 30.0)
            load.report.counter = int(admin.get(load.key) or 0)
            noscript = admin.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0)
        s = _report("script_flush", load.report, record_property)
        assert noscript >= 5, s  # the flushes really hit calls
        assert load.report.calls_failed == 0, s
        assert (s["lost"], s["doubled"]) == (0, 0), s
    finally:
        load.stop()
        await lim.close()
        server.stop()


async def _cluster_drill(tmp_path: Path, *, graceful: bool) -> tuple[Report, Metrics]:
    cluster = HaCluster(
        tmp_path / "cluster", node_timeout_ms=2000, extra=["--enable-debug-command", "local"]
    )
    metrics = Metrics()
    lim = RedisLimiter.from_url(
        cluster.url, timeout_ms=250, metrics=metrics, breaker=BreakerSettings(open_s=0.5)
    )
    load = Load(lim, "cluster")
    old = cluster.primary_of(load.key)
    # another tenant, on another primary
    other = next(n for n in range(100) if cluster.primary_of(f"drill:{{quiet{n}}}:tpm") != old)
    quiet = Load(lim, f"quiet{other}", workers=2, seed=11)
    try:
        replica = cluster.replica_of(old)
        running = load.start(deadline_s=40.0)
        quiet_running = quiet.start(deadline_s=40.0)
        await asyncio.sleep(WARM_S)
        load.report.fault_at = time.monotonic()
        if graceful:
            with redis.Redis(port=replica) as r:
                r.execute_command("CLUSTER", "FAILOVER")
        else:
            cut = cluster.cut_replication(replica, 1.0)
            await asyncio.to_thread(_cut_off, old, load.key)
            load.report.fault_at = time.monotonic()
            cluster.kill(old)
            await asyncio.to_thread(cut.join, 5)
        new, promoted = await asyncio.to_thread(cluster.wait_new_primary, load.key, old, 40.0)
        load.report.promoted_at = promoted
        await asyncio.to_thread(cluster.wait_ok, 30.0, {old})
        await asyncio.sleep(AFTER_S)
        load.stop()
        quiet.stop()
        await asyncio.wait_for(asyncio.gather(running, quiet_running), 45.0)
        with redis.Redis(port=new) as m:
            load.report.counter = int(m.get(load.key) or 0)
            _server_errors(load.report, m.info("errorstats"))
        quiet_primary = cluster.primary_of(quiet.key, avoid={old})
        with redis.Redis(port=quiet_primary) as q:
            quiet.report.counter = int(q.get(quiet.key) or 0)
        assert (quiet.report.lost, quiet.report.doubled) == (0, 0)
        load.report.errors["other_primary_tenant_failed_calls"] = quiet.report.calls_failed
        return load.report, metrics
    finally:
        load.stop()
        quiet.stop()
        await lim.close()
        cluster.stop()


async def test_cluster_primary_sigkill(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """3 primaries / 3 replicas, node timeout 2 s: the busy tenant's primary SIGKILLed after
    its replica's link was cut for 0.3 s: the journal's entries of that slot are replayed to
    the promoted replica: 0 lost, 0 doubled; no call started 2 s after the promotion fails."""
    report, metrics = await _cluster_drill(tmp_path, graceful=False)
    s = _report("cluster_sigkill", report, record_property)
    assert report.unfinished == 0, s
    assert (s["lost"], s["doubled"]) == (0, 0), s
    assert report.failed_after_promotion == 0, s
    assert (metrics.registry.get_sample_value("aiq_redis_failovers_total") or 0) >= 1, s


async def test_cluster_graceful_failover(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """CLUSTER FAILOVER on the busy tenant's replica (the primary hands over once the replica
    caught up): 0 lost, 0 doubled, and no call fails 2 s after the promotion."""
    report, _ = await _cluster_drill(tmp_path, graceful=True)
    s = _report("cluster_graceful_failover", report, record_property)
    assert report.unfinished == 0, s
    assert (s["lost"], s["doubled"]) == (0, 0), s
    assert report.failed_after_promotion == 0, s


@pytest.mark.parametrize("tolerance_s", [0.0, 3.0])
async def test_stream_charge_tolerates_a_short_outage(tmp_path: Path, tolerance_s: float) -> None:
    """Redis frozen 1 s (SIGSTOP) while a stream charges: with AIQ_REDIS_STREAM_TOLERANCE_S=3
    the charge is sent again (same sequence number) until Redis answers, and lands once; with
    0 the stream is told at once (its failure mode applies)."""
    server = RedisServer(tmp_path / "redis")
    lim = RedisLimiter.from_url(
        server.url,
        timeout_ms=150,
        stream_tolerance_s=tolerance_s,
        breaker=BreakerSettings(open_s=0.3),
    )
    t = f"tol:{{{tolerance_s}}}"
    far = int(time.time() * 1000) + 60_000
    b = [BucketCharge(f"{t}:tpm", "tpm", 10, 10**9, far)]
    try:
        assert (
            await lim.admit(f"{t}:r", b, tpm_charged=10, count_refused=False, ledger_ttl_ms=60_000)
        ).admitted
        os.kill(server.proc.pid, signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        loop.call_later(1.0, os.kill, server.proc.pid, signal.SIGCONT)
        started = time.monotonic()
        if tolerance_s:
            res = await lim.charge(f"{t}:r", 1, b, 25, strict=False, ledger_ttl_ms=60_000)
            assert res.granted == 25
            assert 0.9 < time.monotonic() - started < tolerance_s
        else:
            with pytest.raises(LimiterUnavailable):
                await lim.charge(f"{t}:r", 1, b, 25, strict=False, ledger_ttl_ms=60_000)
            assert time.monotonic() - started < 0.9
            await asyncio.sleep(1.2)
        with redis.Redis(port=server.port) as r:
            assert int(r.get(f"{t}:tpm") or 0) in ((35,) if tolerance_s else (10, 35))
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await lim.close()
        server.stop()
