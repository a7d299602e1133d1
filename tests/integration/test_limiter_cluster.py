"""The same Lua scripts on a real three-node Redis Cluster: every call's keys share one slot."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from extproc.clock import FakeClock
from extproc.core.keys import ledger_key, windowed
from extproc.core.rules import Adjustment, BucketCharge, Limit
from extproc.limiter.redis import RedisLimiter
from extproc.stack import free_port

pytestmark = pytest.mark.integration


def _port_with_bus() -> int:
    """A free port whose cluster-bus port (port + 10000) is valid and free too."""
    from extproc.stack import port_in_use

    while True:
        p = free_port()
        if p + 10000 <= 65535 and not port_in_use(p + 10000):
            return p


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Three masters on free ports, slots assigned with redis-cli --cluster create."""
    server = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail("redis-server and redis-cli are required (apt-get install redis-server)")
    base = Path(tmp_path_factory.mktemp("cluster"))
    ports = [_port_with_bus() for _ in range(3)]
    procs = []
    for p in ports:
        d = base / str(p)
        d.mkdir()
        procs.append(
            subprocess.Popen(  # noqa: S603
                [
                    server,
                    "--port",
                    str(p),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(d / "nodes.conf"),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(d),
                ],
                stdout=(d / "log").open("wb"),
                stderr=subprocess.STDOUT,
            )
        )
    try:
        for p in ports:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(port=p).ping()
                    break
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 20
        while redis.Redis(port=ports[0]).cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                pytest.fail("the test cluster did not reach state ok")
            time.sleep(0.1)
        yield ports
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait(10)


async def test_admit_charge_settle_on_a_cluster(cluster: list[int]) -> None:
    """Admission, a stream charge and settlement run on Redis Cluster without CROSSSLOT errors."""
    lim = RedisLimiter.from_url(
        f"redis+cluster://127.0.0.1:{cluster[0]}", timeout_ms=2000, clock=FakeClock()
    )
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    limits = (
        Limit("rpm", 10, 60, "*", "tenant"),
        Limit("tpm", 1000, 60, "*", "tenant"),
        Limit("tpm", 500, 3600, "m", "key"),
    )
    now = int(time.time() * 1000)
    buckets = windowed("aiq", tenant, "k1", limits, now)
    led = ledger_key("aiq", tenant, "req-1")
    charges = [
        BucketCharge(
            b.key, b.metric, 1 if b.metric == "rpm" else 100, b.limit.limit, b.expire_at_ms
        )
        for b in buckets
    ]
    res = await lim.admit(led, charges, tpm_charged=100, count_refused=False, ledger_ttl_ms=60_000)
    assert res.admitted and res.values == (1, 100, 100)
    tpm = [c for c in charges if c.kind == "tpm"]
    ch = await lim.charge(led, 1, tpm, 450, strict=True, ledger_ttl_ms=60_000)
    assert ch.granted == 400 and ch.exhausted  # the 500/hour key bucket binds
    assert await lim.settle(
        led, [Adjustment(c.key, -300, c.expire_at_ms) for c in tpm], ledger_ttl_ms=60_000
    )
    assert await lim.read([b.key for b in buckets]) == [1, 200, 200]
    await lim.close()
    # every key of the tenant lives in one slot
    r = redis.Redis(port=cluster[0])
    slots = {r.cluster("keyslot", b.key) for b in buckets} | {r.cluster("keyslot", led)}
    assert len(slots) == 1
