"""The Redis failover drills, shared by ``scripts/bench --only failover`` and
tests/faults/test_redis_ha_drills.py: a Sentinel group's master, or a Cluster primary, fails
under the mixed load of :mod:`extproc.bench.ha_load`, after the replicas' link was cut for a
moment so that the master dies holding acknowledged writes no replica has (the asynchronous
replication loss); or a graceful ``CLUSTER FAILOVER``.  Each returns the load's
:class:`~extproc.bench.ha_load.Report`: time from the fault to the promotion and to the first
success, calls failed after the promotion, tokens lost and doubled against ground truth,
NOSCRIPT / READONLY errors.  Bounded: each well under a minute."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from extproc.bench.ha_load import Load, Report
from extproc.bench.redis_ha import HaCluster, SentinelGroup
from extproc.limiter.breaker import BreakerSettings
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics

WARM_S = 1.5  # load before the fault
AFTER_S = 3.0  # load kept after the promotion


def cut_off(master: int, key: str) -> None:
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


def server_errors(report: Report, errorstats: dict[str, dict[str, int]]) -> None:
    """The new master's NOSCRIPT / READONLY / MOVED... counts (ERR is left out: redis-py's
    CLIENT SETINFO on each new connection, which Redis 7.0 does not know)."""
    for name, stat in errorstats.items():
        if name != "errorstat_ERR":
            report.errors[f"server:{name.removeprefix('errorstat_')}"] += int(stat["count"])


async def sentinel_drill(tmp_path: Path, *, journal_s: float) -> tuple[Report, Metrics, int]:
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
        await asyncio.to_thread(cut_off, old, load.key)
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
        server_errors(load.report, errorstats)
        return load.report, metrics, new
    finally:
        load.stop()
        await lim.close()
        group.stop()


async def cluster_drill(tmp_path: Path, *, graceful: bool) -> tuple[Report, Metrics]:
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
            await asyncio.to_thread(cut_off, old, load.key)
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
            server_errors(load.report, m.info("errorstats"))
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
