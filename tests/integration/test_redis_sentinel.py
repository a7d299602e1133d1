"""Everything that talks to Redis works on a real Sentinel group (a master, two replicas,
three sentinels on loopback): the limiter, the usage-record writer, the admin store and the
export command's client all reach the master through ``redis+sentinel://``; an unknown master
name is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.admin.store import AdminStore
from extproc.bench.redis_ha import SentinelGroup
from extproc.core.rules import BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.redis import RedisLimiter
from extproc.limiter.redis_url import RedisUrlError, check_master
from extproc.records import export
from extproc.records.writer import redis_client
from extproc.stack import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    g = SentinelGroup(Path(tmp_path_factory.mktemp("sentinel")), replicas=1)
    yield g
    g.stop()


def _master(group: SentinelGroup) -> redis.Redis:
    return redis.Redis(port=group.master_port(), decode_responses=True)


async def test_limiter_charges_the_master(group: SentinelGroup) -> None:
    lim = RedisLimiter.from_url(group.url(), timeout_ms=500)
    t = f"s:{{{uuid.uuid4().hex[:8]}}}"
    far = int(time.time() * 1000) + 60_000
    try:
        res = await lim.admit(
            AdmitCall(
                f"{t}:req",
                [BucketCharge(f"{t}:tpm", "tpm", 42, 1000, far)],
                tpm_charged=42,
                count_refused=False,
                ledger_ttl_ms=60_000,
            )
        )
        assert res.admitted
        assert await lim.ping()
    finally:
        await lim.close()
    with _master(group) as m:
        assert m.get(f"{t}:tpm") == "42"


async def test_records_admin_and_export_clients_reach_the_master(group: SentinelGroup) -> None:
    key = f"s:{uuid.uuid4().hex[:8]}"
    writer = redis_client(group.url())
    try:
        await writer.set(f"{key}:w", "1")
    finally:
        await writer.aclose()
    store = AdminStore.from_url(group.url(), prefix=key)
    try:
        assert await store.version() == 0
        await store.client.set(f"{key}:a", "1")
    finally:
        await store.close()
    sync = export.sync_client(group.url())
    try:
        sync.set(f"{key}:e", "1")
    finally:
        sync.close()
    with _master(group) as m:
        assert [m.get(f"{key}:{s}") for s in "wae"] == ["1", "1", "1"]


async def test_unknown_master_name_is_a_clear_error(group: SentinelGroup) -> None:
    with pytest.raises(RedisUrlError, match="no sentinel knows a master named 'nope'"):
        await check_master(group.url(name="nope"))
    await check_master(group.url())  # the right name passes
    lim = RedisLimiter.from_url(group.url(name="nope"), timeout_ms=300)
    try:
        with pytest.raises(LimiterUnavailable, match="MasterNotFoundError"):
            await lim.read(["x"])
    finally:
        await lim.close()


def _serve(group: SentinelGroup, url: str) -> tuple[subprocess.Popen[bytes], int]:
    grpc_port = free_port()
    env = {
        **os.environ,
        "AIQ_CONFIG": str(ROOT / "config/demo.yaml"),
        "AIQ_REDIS_URL": url,
        "AIQ_GRPC_ADDRESS": f"127.0.0.1:{grpc_port}",
        "AIQ_INSECURE": "1",  # this test is about Redis, not the port's door
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, grpc_port


def test_serve_on_a_sentinel_url_answers_from_the_master(group: SentinelGroup) -> None:
    """`ai-quota serve` with AIQ_REDIS_URL=redis+sentinel://...: SERVING once the master
    answered, the usage API reads the tenant's counters through it, exit 0 on SIGTERM."""
    proc, port = _serve(group, group.url())
    try:
        deadline = time.monotonic() + 30
        status = None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                try:
                    status = stub.Check(
                        health_pb2.HealthCheckRequest(service="aiquota.v1.Redis"), timeout=1
                    ).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            resp = usage_pb2_grpc.UsageStub(ch).GetUsage(
                usage_pb2.GetUsageRequest(api_key="sk-demo-tight"), timeout=10
            )
        assert resp.tenant == "demo-tight"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]


def test_serve_with_an_unknown_master_name_exits_2(group: SentinelGroup) -> None:
    proc, _ = _serve(group, group.url(name="nope"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert b"no sentinel knows a master named 'nope'" in out


async def test_rediss_sentinel_speaks_tls_to_sentinels_and_master(tmp_path: Path) -> None:
    """A group listening with TLS only (servers, sentinels, replication):
    ``rediss+sentinel://...?ssl_ca_certs=`` reaches the master through the sentinels and
    charges it; without the CA the certificate is refused."""
    cert = tmp_path / "redis.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(cert.with_suffix(".key")), "-out", str(cert)),
            *("-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    group = SentinelGroup(tmp_path / "tls", replicas=1, tls_cert=cert)
    try:
        url = group.url("rediss+sentinel") + f"?ssl_ca_certs={cert}"
        lim = RedisLimiter.from_url(url, timeout_ms=1000)
        t = f"tls:{{{uuid.uuid4().hex[:8]}}}"
        far = int(time.time() * 1000) + 60_000
        try:
            res = await lim.admit(
                AdmitCall(
                    f"{t}:req",
                    [BucketCharge(f"{t}:tpm", "tpm", 9, 1000, far)],
                    tpm_charged=9,
                    count_refused=False,
                    ledger_ttl_ms=60_000,
                )
            )
            assert res.admitted
        finally:
            await lim.close()
        with redis.Redis(
            port=group.master_port(), ssl=True, ssl_ca_certs=str(cert), decode_responses=True
        ) as m:
            assert m.get(f"{t}:tpm") == "9"
        untrusted = RedisLimiter.from_url(group.url("rediss+sentinel"), timeout_ms=1000)
        try:
            with pytest.raises(LimiterUnavailable):
                await untrusted.read([f"{t}:tpm"])
        finally:
            await untrusted.close()
    finally:
        group.stop()
