"""Conformance with envoyproxy/ratelimit's documented behaviour (their README's configuration
section and examples, and their integration scenarios), written from the documentation: each
test states the documented rule it checks, over real gRPC and a real redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rls_support import OK, OVER, Serve, metric, request

pytestmark = pytest.mark.integration


def write(tmp_path: Path, text: str) -> Path:
    """One domain's config file."""
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


async def codes(stub: object, req: object, n: int) -> list[int]:
    """The overall codes of ``n`` identical calls."""
    out = []
    for _ in range(n):
        r = await stub.ShouldRateLimit(req)  # type: ignore[attr-defined]
        out.append(int(r.overall_code))
    return out


async def test_two_values_of_one_key_are_separate_limits(serve: Serve, tmp_path: Path) -> None:
    """Two descriptors with the same key and different values are two limits."""
    cfg = write(
        tmp_path,
        """
domain: db
descriptors:
  - key: database
    value: users
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: database
    value: default
    rate_limit: {unit: second, requests_per_unit: 3}
""",
    )
    stub, _ = await serve(cfg)
    assert await codes(stub, request("db", [("database", "users")]), 3) == [OK, OK, OVER]
    assert await codes(stub, request("db", [("database", "default")]), 4) == [OK, OK, OK, OVER]
    r = await stub.ShouldRateLimit(request("db", [("database", "other")]))
    assert r.overall_code == OK and not r.statuses[0].HasField("current_limit")


NESTED = """
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {unit: day, requests_per_unit: 2}
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 3}
"""


async def test_nested_valueless_key_counts_per_value(serve: Serve, tmp_path: Path) -> None:
    """A nested value-less key gives each value its own counter under its parent."""
    stub, _ = await serve(write(tmp_path, NESTED))
    a = request("messaging", [("message_type", "marketing"), ("to_number", "111")])
    b = request("messaging", [("message_type", "marketing"), ("to_number", "222")])
    assert await codes(stub, a, 3) == [OK, OK, OVER]
    assert await codes(stub, b, 2) == [OK, OK]


async def test_several_descriptors_answer_the_or(serve: Serve, tmp_path: Path) -> None:
    """Several descriptors in one call: over when any is over, one status each."""
    stub, _ = await serve(write(tmp_path, NESTED))
    req = request(
        "messaging",
        [("message_type", "marketing"), ("to_number", "333")],
        [("to_number", "333")],
    )
    r1 = await stub.ShouldRateLimit(req)
    assert r1.overall_code == OK
    assert [s.limit_remaining for s in r1.statuses] == [1, 2]
    await stub.ShouldRateLimit(req)
    r3 = await stub.ShouldRateLimit(req)
    assert r3.overall_code == OVER
    assert [s.code for s in r3.statuses] == [OVER, OK]


async def test_specific_value_beats_the_key(serve: Serve, tmp_path: Path) -> None:
    """The most specific match wins: a key/value rule (here 0, a block list) over the key."""
    cfg = write(
        tmp_path,
        """
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
""",
    )
    stub, _ = await serve(cfg)
    blocked = await stub.ShouldRateLimit(request("edge", [("remote_address", "50.0.0.5")]))
    assert blocked.overall_code == OVER
    assert blocked.statuses[0].current_limit.requests_per_unit == 0
    other = await stub.ShouldRateLimit(request("edge", [("remote_address", "50.0.0.1")]))
    assert other.overall_code == OK and other.statuses[0].limit_remaining == 9


async def test_depth_must_equal_the_entries(serve: Serve, tmp_path: Path) -> None:
    """A request with more entries than the matching rule's depth gets no limit."""
    cfg = write(
        tmp_path,
        """
domain: depth
descriptors:
  - key: key
    value: value
    rate_limit: {unit: second, requests_per_unit: 0}
""",
    )
    stub, _ = await serve(cfg)
    deeper = await stub.ShouldRateLimit(
        request("depth", [("key", "value"), ("subkey", "subvalue")])
    )
    assert deeper.overall_code == OK and not deeper.statuses[0].HasField("current_limit")
    exact = await stub.ShouldRateLimit(request("depth", [("key", "value")]))
    assert exact.overall_code == OVER


async def test_unlimited_returns_max_remaining(serve: Serve, tmp_path: Path) -> None:
    """An unlimited descriptor is OK with LimitRemaining = MaxUint32; a limited one beside it
    still counts."""
    cfg = write(
        tmp_path,
        """
domain: internal
descriptors:
  - key: ldap
    rate_limit: {unlimited: true}
  - key: azure
    rate_limit: {unit: minute, requests_per_unit: 1}
""",
    )
    stub, _ = await serve(cfg)
    for _ in range(3):
        r = await stub.ShouldRateLimit(request("internal", [("ldap", "x")]))
        assert r.overall_code == OK and r.statuses[0].limit_remaining == 2**32 - 1
    assert await codes(stub, request("internal", [("azure", "x")]), 2) == [OK, OVER]


async def test_shadow_mode_never_refuses_but_counts(serve: Serve, tmp_path: Path) -> None:
    """A shadow_mode rule answers OK past its limit and counts shadow_mode hits; a sibling
    rule without it limits."""
    cfg = write(
        tmp_path,
        """
domain: shadow
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        shadow_mode: true
        rate_limit: {unit: second, requests_per_unit: 2}
      - key: user
        value: user-b
        rate_limit: {unit: second, requests_per_unit: 2}
""",
    )
    stub, running = await serve(cfg)
    a = request("shadow", [("service", "auth"), ("user", "user-a")])
    b = request("shadow", [("service", "auth"), ("user", "user-b")])
    assert await codes(stub, a, 5) == [OK] * 5
    assert await codes(stub, b, 3) == [OK, OK, OVER]
    rule = "shadow.service.user_user-a"
    assert metric(running, "aiq_rls_shadow_mode_total", domain="shadow", rule=rule) == 3
    assert metric(running, "aiq_rls_total_hits_total", domain="shadow", rule=rule) == 5


async def test_global_shadow_mode_answers_ok(serve: Serve, tmp_path: Path) -> None:
    """Global shadow mode: over-limit descriptors are reported, the answer is OK."""
    cfg = write(
        tmp_path,
        "domain: g\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )
    stub, running = await serve(cfg, rls_shadow_mode=True)
    await stub.ShouldRateLimit(request("g", [("k", "v")]))
    r = await stub.ShouldRateLimit(request("g", [("k", "v")]))
    assert r.overall_code == OK and r.statuses[0].code == OVER
    assert metric(running, "aiq_rls_global_shadow_mode_total") == 1


REPLACES = """
domain: rep
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: u
        rate_limit: {name: specific, unit: second, requests_per_unit: 1}
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: u
        rate_limit:
          unit: second
          requests_per_unit: 3
          replaces: [{name: specific}]
"""


async def test_replaces(serve: Serve, tmp_path: Path) -> None:
    """A rule that replaces a named one removes it from requests carrying both; alone, the
    replaced rule still applies."""
    stub, _ = await serve(write(tmp_path, REPLACES))
    both = request(
        "rep", [("key_1", "value_1"), ("user", "u")], [("key_2", "value_2"), ("user", "u")]
    )
    r = await stub.ShouldRateLimit(both)
    assert not r.statuses[0].HasField("current_limit")
    assert r.statuses[1].current_limit.requests_per_unit == 3
    assert await codes(stub, both, 3) == [OK, OK, OVER]
    alone = request("rep", [("key_1", "value_1"), ("user", "u")])
    assert await codes(stub, alone, 2) == [OK, OVER]


async def test_wildcards(serve: Serve, tmp_path: Path) -> None:
    """A value with '*' matches by pattern, after exact values and before the bare key; each
    matching value has its own counter unless share_threshold."""
    cfg = write(
        tmp_path,
        """
domain: wild
descriptors:
  - key: path
    value: /api/admin
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: path
    value: "/api/*"
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: "/files/*"
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 9}
""",
    )
    stub, _ = await serve(cfg)

    async def limit(value: str) -> int:
        r = await stub.ShouldRateLimit(request("wild", ([("path", value)], 0)))
        return int(r.statuses[0].current_limit.requests_per_unit)

    assert [await limit(v) for v in ("/api/admin", "/api/x", "/other")] == [5, 1, 9]
    assert await codes(stub, request("wild", [("path", "/api/a")]), 2) == [OK, OVER]
    assert await codes(stub, request("wild", [("path", "/api/b")]), 1) == [OK]
    assert await codes(stub, request("wild", [("path", "/files/a")]), 1) == [OK]
    assert await codes(stub, request("wild", [("path", "/files/b")]), 1) == [OVER]


async def test_hits_addend(serve: Serve, tmp_path: Path) -> None:
    """Request hits_addend 0 counts 1; a descriptor's hits_addend wins; an explicit 0 only
    checks (OVER_LIMIT once the counter is past the limit, nothing added)."""
    cfg = write(
        tmp_path,
        "domain: h\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    )
    stub, _ = await serve(cfg)
    r = await stub.ShouldRateLimit(request("h", [("k", "v")], hits=0))
    assert r.statuses[0].limit_remaining == 9
    r = await stub.ShouldRateLimit(request("h", [("k", "v")], hits=4))
    assert r.statuses[0].limit_remaining == 5
    r = await stub.ShouldRateLimit(request("h", ([("k", "v")], 5), hits=100))
    assert r.overall_code == OK and r.statuses[0].limit_remaining == 0
    for _ in range(2):
        check = await stub.ShouldRateLimit(request("h", ([("k", "v")], 0)))
        assert check.overall_code == OK and check.statuses[0].limit_remaining == 0
    r = await stub.ShouldRateLimit(request("h", [("k", "v")]))
    assert r.overall_code == OVER


async def test_near_limit_counts(serve: Serve, tmp_path: Path) -> None:
    """near_limit counts hits past the ratio (0.8 by default, configurable) of the limit;
    within_limit and over_limit the hits inside and past it."""
    cfg = write(
        tmp_path,
        "domain: n\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    )
    stub, running = await serve(cfg)
    for _ in range(12):
        await stub.ShouldRateLimit(request("n", [("k", "v")]))
    labels = {"domain": "n", "rule": "n.k"}
    assert metric(running, "aiq_rls_total_hits_total", **labels) == 12
    assert metric(running, "aiq_rls_within_limit_total", **labels) == 10
    assert metric(running, "aiq_rls_near_limit_total", **labels) == 2  # hits 9 and 10
    assert metric(running, "aiq_rls_over_limit_total", **labels) == 2
    stub2, running2 = await serve(cfg, rls_near_limit_ratio=0.5)
    for _ in range(10):
        await stub2.ShouldRateLimit(request("n", [("k", "w")]))
    assert metric(running2, "aiq_rls_near_limit_total", **labels) == 5


async def test_detailed_metric_names_values(serve: Serve, tmp_path: Path) -> None:
    """detailed_metric labels the rule's counters with the request's values."""
    cfg = write(
        tmp_path,
        "domain: dm\ndescriptors:\n  - key: k\n    detailed_metric: true\n"
        "    rate_limit: {unit: minute, requests_per_unit: 10}\n",
    )
    stub, running = await serve(cfg)
    await stub.ShouldRateLimit(request("dm", [("k", "abc")]))
    assert metric(running, "aiq_rls_total_hits_total", domain="dm", rule="dm.k_abc") == 1


async def test_limit_override_from_envoy(serve: Serve, tmp_path: Path) -> None:
    """A descriptor's own limit (Envoy's route override) applies, even without a rule, in a
    known domain (theirs: in any configured domain; ours: in a domain that sets
    ``allow_limit_override``, elsewhere it is ignored and the rules decide)."""
    from envoy.type.v3 import ratelimit_unit_pb2

    stub, running = await serve(
        write(tmp_path, "domain: o\nallow_limit_override: true\ndescriptors: []\n")
    )
    req = request("o", [("any", "x")])
    req.descriptors[0].limit.requests_per_unit = 1
    req.descriptors[0].limit.unit = ratelimit_unit_pb2.MINUTE
    assert await codes(stub, req, 2) == [OK, OVER]
    assert metric(running, "aiq_rls_over_limit_total", domain="o", rule="override") == 1
    # the same request in a domain that does not allow overrides: no rule, no limit
    stub2, running2 = await serve(write(tmp_path, "domain: o\ndescriptors: []\n"))
    assert await codes(stub2, req, 2) == [OK, OK]
    assert metric(running2, "aiq_rls_overrides_ignored_total", domain="o") == 2
