"""What a ``ShouldRateLimit`` caller's own text can make the gateway count or store (issue 24),
over real gRPC against ``ai-quota serve`` in process and a real redis-server: the RLS API only
with an RLS config, unknown domains and disallowed overrides counting nothing, the caps on a
request, bounded metric series, ``unit_multiplier`` windows, and the ``ai_quota`` link charging
only the tenants the config lets through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2
from envoy.type.v3 import ratelimit_unit_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import Running
from tests.helpers import RedisServer
from tests.rls_support import OK, OVER, SEED_DIR, Serve, fake_clock, request

pytestmark = pytest.mark.integration

RLS = "envoy.service.ratelimit.v3.RateLimitService"


def keys_of(server: RedisServer, running: Running) -> list[bytes]:
    """Every Redis key the running server's prefix owns."""
    client = redis.Redis(port=server.port)
    try:
        return list(client.scan_iter(match=f"{running.gateway.key_prefix}:*", count=1000))
    finally:
        client.close()


def with_override(req: Any, index: int, rpu: int, unit: int = ratelimit_unit_pb2.YEAR) -> Any:
    """The request with a ``limit`` override on descriptor ``index``."""
    req.descriptors[index].limit.requests_per_unit = rpu
    req.descriptors[index].limit.unit = unit
    return req


def series(running: Running) -> int:
    """How many labelled series the replica's registry holds for the RLS metrics."""
    n = 0
    for fam in running.gateway.metrics.registry.collect():
        if fam.name.startswith("aiq_rls_"):
            n += len({tuple(sorted(s.labels.items())) for s in fam.samples})
    return n


async def test_no_rls_config_no_rls_api(serve: Serve) -> None:
    """Without an RLS config the RLS service is not registered: ShouldRateLimit gets
    UNIMPLEMENTED and the health service does not answer for it, while ext_proc's health does."""
    stub, running = await serve("")
    assert running.rls is None and running.rls_port == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ShouldRateLimit(request("ai-gateway", [("tenant", "acme")]))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await health.Check(health_pb2.HealthCheckRequest(service=RLS))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        ext_proc = await health.Check(
            health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor")
        )
        assert ext_proc.status in (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
    # AIQ_RLS_ADDRESS without a config binds nothing either
    from extproc.stack import free_port, port_in_use

    port = free_port()
    _, alone = await serve("", rls_address=f"127.0.0.1:{port}")
    assert alone.rls is None and alone.rls_server is None and not port_in_use(port)
    # with a config, the same call is served
    stub2, running2 = await serve(SEED_DIR)
    assert running2.rls is not None
    ok = await stub2.ShouldRateLimit(request("ai-gateway", [("tenant", "acme")]))
    assert ok.overall_code == OK


async def test_unknown_domains_and_disallowed_overrides_store_nothing(
    serve: Serve, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The issue's attack: 50 calls in unknown domains, each with a descriptor limit override
    (1 per year) and a 100-character value, create no Redis key and answer OK; the same in a
    configured domain that does not allow overrides (descriptors matching no rule) neither."""
    cfg = tmp_path / "d.yaml"
    cfg.write_text(
        "domain: known\ndescriptors:\n  - key: k\n    value: v\n"
        "    rate_limit: {unit: minute, requests_per_unit: 5}\n"
    )
    stub, running = await serve(cfg)
    for i in range(50):
        value = f"{i:03d}" + "x" * 97
        req = with_override(request(f"attack-{i}-{value}", [("path", value)]), 0, 1)
        for _ in range(2):  # past the override's limit of 1: still OK, nothing counted
            r = await stub.ShouldRateLimit(req)
            assert r.overall_code == OK and not r.statuses[0].HasField("current_limit")
        known = with_override(request("known", [("path", value)]), 0, 1)
        r = await stub.ShouldRateLimit(known)
        assert r.overall_code == OK and not r.statuses[0].HasField("current_limit")
    assert keys_of(redis_server, running) == []
    reg = running.gateway.metrics.registry
    assert reg.get_sample_value("aiq_rls_unknown_domain_total") == 100
    assert reg.get_sample_value("aiq_rls_overrides_ignored_total", {"domain": "known"}) == 50
    # the configured rule still counts (and only it): one key
    assert (await stub.ShouldRateLimit(request("known", [("k", "v")]))).overall_code == OK
    assert len(keys_of(redis_server, running)) == 1


async def test_override_counts_in_a_domain_that_allows_it(
    serve: Serve, redis_server: RedisServer, tmp_path: Path
) -> None:
    """allow_limit_override: the override's limit applies (envoyproxy/ratelimit's behaviour)."""
    cfg = tmp_path / "o.yaml"
    cfg.write_text("domain: o\nallow_limit_override: true\ndescriptors: []\n")
    stub, running = await serve(cfg)
    req = with_override(request("o", [("any", "x")]), 0, 1, ratelimit_unit_pb2.MINUTE)
    first, second = await stub.ShouldRateLimit(req), await stub.ShouldRateLimit(req)
    assert (first.overall_code, second.overall_code) == (OK, OVER)
    assert first.statuses[0].current_limit.requests_per_unit == 1
    assert len(keys_of(redis_server, running)) == 1


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (
            lambda: request("d", *([[("tenant", "a")]] * 5)),
            "5 descriptors in one request, more than the cap AIQ_RLS_MAX_DESCRIPTORS=4",
        ),
        (
            lambda: request("d", [("k", "v")] * 4),
            "descriptor 0 has 4 entries, more than the cap AIQ_RLS_MAX_ENTRIES=3",
        ),
        (
            lambda: request("d", [("k" * 9, "v")]),
            "descriptor 0 has a key of 9 characters, more than the cap AIQ_RLS_MAX_KEY_LENGTH=8",
        ),
        (
            lambda: request("d", [("tenant", "v" * 17)]),
            "descriptor 0 has a value of 17 characters, more than the cap "
            "AIQ_RLS_MAX_VALUE_LENGTH=16",
        ),
        (
            lambda: request("d", [("tenant", "a")], hits=1001),
            "hits_addend 1001 is more than the cap AIQ_RLS_MAX_HITS_ADDEND=1000",
        ),
        (
            lambda: request("d", ([("tenant", "a")], 1001)),
            "descriptor 0's hits_addend 1001 is more than the cap AIQ_RLS_MAX_HITS_ADDEND=1000",
        ),
        (
            lambda: request("d" * 9, [("tenant", "a")]),
            "the domain is 9 characters, more than the cap AIQ_RLS_MAX_KEY_LENGTH=8",
        ),
    ],
)
async def test_caps_are_invalid_argument_naming_the_cap(
    serve: Serve, redis_server: RedisServer, build: Any, named: str
) -> None:
    """Each cap, set by its setting, refuses a request past it with INVALID_ARGUMENT naming
    the cap; nothing is stored."""
    stub, running = await serve(
        SEED_DIR,
        rls_max_descriptors=4,
        rls_max_entries=3,
        rls_max_key_length=8,
        rls_max_value_length=16,
        rls_max_hits_addend=1000,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ShouldRateLimit(build())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == named
    assert keys_of(redis_server, running) == []
    reg = running.gateway.metrics.registry
    assert reg.get_sample_value("aiq_rls_requests_total", {"code": "INVALID_ARGUMENT"}) == 1


async def test_default_caps(serve: Serve) -> None:
    """The defaults: 32 descriptors pass and 33 are refused; hits_addend 1,000,000 passes and
    1,000,001 is refused; a 512-character value passes and 513 is refused."""
    stub, _ = await serve(SEED_DIR)
    seed = [("tenant", "t-caps"), ("model", "m"), ("metric", "tpm")]
    assert (await stub.ShouldRateLimit(request("ai-gateway", *[seed] * 32))).overall_code == OK
    with pytest.raises(grpc.aio.AioRpcError, match="AIQ_RLS_MAX_DESCRIPTORS=32"):
        await stub.ShouldRateLimit(request("ai-gateway", *[seed] * 33))
    r = await stub.ShouldRateLimit(request("ai-gateway", seed, hits=1_000_000))
    assert r.overall_code == OVER  # past the 100,000 TPM, not past the cap
    with pytest.raises(grpc.aio.AioRpcError, match="AIQ_RLS_MAX_HITS_ADDEND=1000000"):
        await stub.ShouldRateLimit(request("ai-gateway", seed, hits=1_000_001))
    long_ok = [("tenant", "t"), ("model", "m" * 512), ("metric", "rpm")]
    assert (await stub.ShouldRateLimit(request("ai-gateway", long_ok))).overall_code == OK
    with pytest.raises(grpc.aio.AioRpcError, match="AIQ_RLS_MAX_VALUE_LENGTH=512"):
        await stub.ShouldRateLimit(
            request("ai-gateway", [("tenant", "t"), ("model", "m" * 513), ("metric", "rpm")])
        )


async def test_ten_thousand_caller_values_make_a_bounded_number_of_series(
    serve: Serve, tmp_path: Path
) -> None:
    """10,000 distinct caller values, each sent in every shape a caller controls (a
    detailed_metric rule's value, a value-less key's value, a limit override's entries, a
    descriptor matching nothing, and 1 in 20 as an unknown domain), leave the RLS metrics with
    a bounded number of series: the same count after 10,000 values as after 1,000."""
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        "domain: m\nallow_limit_override: true\ndescriptors:\n"
        "  - key: user\n    detailed_metric: true\n"
        "    rate_limit: {unit: minute, requests_per_unit: 1000000}\n"
        "  - key: path\n    rate_limit: {unit: minute, requests_per_unit: 1000000}\n"
    )
    stub, running = await serve(cfg, rls_detailed_metric_series=50)
    counts = {}
    sent = 0
    for start in range(0, 10_000, 8):  # 8 values x 4 descriptors: 32, the default cap
        values = [f"v{n:05d}-" + "z" * 40 for n in range(start, start + 8)]
        req = rls_pb2.RateLimitRequest(domain="m")
        for v in values:
            for key in ("user", "path", "nothing", "ovr"):
                d = req.descriptors.add()
                d.entries.add(key=key, value=v)
                if key == "ovr":
                    d.limit.requests_per_unit = 1000
                    d.limit.unit = ratelimit_unit_pb2.MINUTE
        r = await stub.ShouldRateLimit(req)
        assert r.overall_code == OK
        if start % 160 == 0:
            other = request(f"unknown-{values[0]}", [("user", values[0])])
            assert (await stub.ShouldRateLimit(other)).overall_code == OK
        sent += len(values)
        if sent in (1000, 10_000):
            counts[sent] = series(running)
    assert sent == 10_000
    assert counts[1000] == counts[10_000], counts
    labels = {
        s.labels.get("rule")
        for fam in running.gateway.metrics.registry.collect()
        if fam.name == "aiq_rls_total_hits"
        for s in fam.samples
        if s.name == "aiq_rls_total_hits_total"
    }
    # 50 detailed values, then the rule's path; the value-less key's path; one override series
    assert len(labels) == 50 + 3, sorted(labels)[:5]
    assert {"m.user", "m.path", "override"} <= labels
    reg = running.gateway.metrics.registry
    assert (
        reg.get_sample_value("aiq_rls_total_hits_total", {"domain": "m", "rule": "override"})
        == 10_000
    )
    assert (
        reg.get_sample_value("aiq_rls_total_hits_total", {"domain": "m", "rule": "m.path"})
        == 10_000
    )
    folded = reg.get_sample_value("aiq_rls_total_hits_total", {"domain": "m", "rule": "m.user"})
    assert folded == 10_000 - 50
    assert counts[10_000] < 400


async def test_unit_multiplier_window(serve: Serve, tmp_path: Path) -> None:
    """unit_multiplier: 5 minutes of 3 requests: the 4th call is refused, the reset counts the
    5-minute window, the answer's unit is MINUTE."""
    cfg = tmp_path / "u.yaml"
    cfg.write_text(
        "domain: u\ndescriptors:\n  - key: k\n"
        "    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 3}\n"
    )
    clock = fake_clock()
    stub, _ = await serve(cfg, clock=clock)
    answers = [await stub.ShouldRateLimit(request("u", [("k", "a")])) for _ in range(4)]
    assert [a.overall_code for a in answers] == [OK, OK, OK, OVER]
    s = answers[0].statuses[0]
    assert s.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.MINUTE
    now_s = clock.now_ms() // 1000
    assert s.duration_until_reset.seconds == 300 - now_s % 300


async def test_link_charges_only_tenants_the_config_lets_through(
    serve: Serve, redis_server: RedisServer, tmp_path: Path
) -> None:
    """An RLS rule linked to ai-quota's counters: with the tenant descriptor's value fixed to
    acme, a call naming another tenant of the rules (other) matches no rule and leaves its
    counters untouched; with a value-less tenant key, a value that is no tenant of the rules
    counts on its own RLS key, never in an ai-quota tenant's key."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "models:\n  sim-small: {tokenizer: {kind: estimate, chars_per_token: 4}, "
        "max_output_tokens: 100}\n"
        "plans:\n  p: {limits: [{model: '*', rpm: 60, tpm: 100000}]}\n"
        "tenants:\n  acme: {plan: p, keys: [{name: a, plaintext: sk-a}]}\n"
        "  other: {plan: p, keys: [{name: o, plaintext: sk-o}]}\n"
    )
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "f.yaml").write_text(
        "domain: f\ndescriptors:\n  - key: tenant\n    value: acme\n    descriptors:\n"
        "      - key: metric\n        value: tpm\n        ai_quota: {bucket: tpm, tenant: tenant}\n"
        "        rate_limit: {unit: minute, requests_per_unit: 100000}\n"
    )
    (fixed / "open.yaml").write_text(
        "domain: open\ndescriptors:\n  - key: tenant\n    descriptors:\n"
        "      - key: metric\n        value: tpm\n        ai_quota: {bucket: tpm, tenant: tenant}\n"
        "        rate_limit: {unit: minute, requests_per_unit: 100000}\n"
    )
    stub, running = await serve(fixed, config=rules)
    prefix = running.gateway.key_prefix
    drain = request("f", [("tenant", "other"), ("metric", "tpm")], hits=90_000)
    r = await stub.ShouldRateLimit(drain)
    assert r.overall_code == OK and not r.statuses[0].HasField("current_limit")
    assert keys_of(redis_server, running) == []
    own = await stub.ShouldRateLimit(request("f", [("tenant", "acme"), ("metric", "tpm")], hits=7))
    assert own.statuses[0].limit_remaining == 100_000 - 7
    (key,) = keys_of(redis_server, running)
    assert key.decode().startswith(f"{prefix}:{{acme}}:tpm:t:*:60:")
    await stub.ShouldRateLimit(request("open", [("tenant", "ghost"), ("metric", "tpm")], hits=5))
    ghost = sorted(k.decode() for k in keys_of(redis_server, running) if b"ghost" in k)
    assert len(ghost) == 1 and ghost[0].startswith(f"{prefix}:{{ghost}}:rls:open:")
    await stub.ShouldRateLimit(request("open", [("tenant", "other"), ("metric", "tpm")], hits=5))
    assert any(
        k.decode().startswith(f"{prefix}:{{other}}:tpm:t:*:60:")
        for k in keys_of(redis_server, running)
    )
