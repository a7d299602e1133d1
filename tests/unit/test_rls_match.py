"""RLS matching and answers, sans-IO: precedence, counters per value, windows, stats, headers."""

from __future__ import annotations

import fnmatch
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.rls import match
from extproc.rls.config import RlsConfig
from extproc.rls.load import compile_domains
from extproc.rls.match import Code, decide, find, plan
from extproc.rls.parse import parse_text
from extproc.rls.request import Caps, Descriptor, RequestError

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000  # a fixed instant (ms)

PRECEDENCE = """
domain: d
descriptors:
  - key: k
    value: exact
    rate_limit: {unit: minute, requests_per_unit: 1, name: exact}
  - key: k
    value: "ex*"
    rate_limit: {unit: minute, requests_per_unit: 2, name: wild}
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 3, name: any}
  - key: nest
    descriptors:
      - key: leaf
        rate_limit: {unit: second, requests_per_unit: 4}
"""


def cfg(text: str) -> RlsConfig:
    """A config of one domain from YAML text."""
    return compile_domains([parse_text(text, "t.yaml")])


def limit_of(c: RlsConfig, *entries: tuple[str, str]) -> int | None:
    """The requests_per_unit that applies to these entries (None: no limit)."""
    f = find(c.domains["d"], entries)
    return None if f is None else f.rule.requests_per_unit


def test_exact_beats_wildcard_beats_valueless() -> None:
    """An exact value wins over a matching wildcard, which wins over the value-less key."""
    c = cfg(PRECEDENCE)
    assert limit_of(c, ("k", "exact")) == 1
    assert limit_of(c, ("k", "example")) == 2
    assert limit_of(c, ("k", "other")) == 3


def test_depth_must_match() -> None:
    """A rule applies only when the last entry lands on it: fewer or more entries, none."""
    c = cfg(PRECEDENCE)
    assert limit_of(c, ("nest", "x"), ("leaf", "y")) == 4
    assert limit_of(c, ("nest", "x")) is None
    assert limit_of(c, ("nest", "x"), ("leaf", "y"), ("extra", "z")) is None
    assert limit_of(c, ("k", "exact"), ("more", "z")) is None
    assert limit_of(c, ("unknown", "x")) is None
    assert limit_of(c, ("nest", "x"), ("other", "y")) is None


def test_valueless_key_counts_each_value_apart() -> None:
    """A value-less key (and a wildcard) give one counter per distinct value."""
    c = cfg(PRECEDENCE)
    keys = {
        plan(c, "d", [Descriptor((("k", v),))], 1, NOW).items[0].counted.key  # type: ignore[union-attr]
        for v in ("a", "b", "exa", "exb")
    }
    assert len(keys) == 4


def test_share_threshold_shares_one_counter() -> None:
    """Under share_threshold, every value a wildcard matches counts in one counter."""
    c = cfg(
        "domain: d\ndescriptors:\n  - key: p\n    value: 'files/*'\n    share_threshold: true\n"
        "    rate_limit: {unit: hour, requests_per_unit: 9}\n"
    )
    a = plan(c, "d", [Descriptor((("p", "files/a"),))], 1, NOW).counted[0]
    b = plan(c, "d", [Descriptor((("p", "files/b"),))], 1, NOW).counted[0]
    assert a.key == b.key and "files%2F%2A" in a.key


def test_unknown_domain_and_no_rule_are_ok_without_counters() -> None:
    """Unknown domain or unmatched descriptor: OK, no current limit, nothing to count."""
    c = cfg(PRECEDENCE)
    p = plan(c, "nope", [Descriptor((("k", "exact"),))], 1, NOW)
    assert p.counted == []
    d = decide(p, [], True)
    assert d.overall is Code.OK and d.statuses[0].rule is None


def test_unlimited_answers_ok_without_counter() -> None:
    """An unlimited rule needs no counter and reports the maximum remaining."""
    c = cfg("domain: d\ndescriptors:\n  - key: u\n    rate_limit: {unlimited: true}\n")
    p = plan(c, "d", [Descriptor((("u", "x"),))], 5, NOW)
    assert p.counted == []
    s = decide(p, [], True).statuses[0]
    assert (s.code, s.limit_remaining, s.rule) == (Code.OK, match.MAX_UINT32, None)


def test_replaces_drops_the_named_rule() -> None:
    """A rule that replaces another by name removes it from the same request."""
    c = cfg(
        """
domain: d
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 1, name: base}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 10, replaces: [{name: base}]}
"""
    )
    both = plan(c, "d", [Descriptor((("a", "x"),)), Descriptor((("b", "y"),))], 1, NOW)
    assert both.items[0].rule is None and both.items[1].counted is not None
    alone = plan(c, "d", [Descriptor((("a", "x"),))], 1, NOW)
    assert alone.items[0].counted is not None


def test_hits_addend_rules() -> None:
    """Request hits 0 means 1; a descriptor's own hits_addend wins, and 0 checks only."""
    c = cfg(PRECEDENCE)
    e = (("k", "a"),)
    assert plan(c, "d", [Descriptor(e)], 0, NOW).counted[0].hits == 1
    assert plan(c, "d", [Descriptor(e)], 7, NOW).counted[0].hits == 7
    assert plan(c, "d", [Descriptor(e, hits_addend=0)], 7, NOW).counted[0].hits == 0
    assert plan(c, "d", [Descriptor(e, hits_addend=3)], 7, NOW).counted[0].hits == 3


def test_windows_are_epoch_aligned() -> None:
    """The counter key changes exactly at the unit's epoch boundary; reset counts down."""
    c = cfg(PRECEDENCE)
    start = (NOW // 60_000 + 1) * 60_000
    k = [
        plan(c, "d", [Descriptor((("k", "a"),))], 1, t).counted[0]
        for t in (start - 1, start, start + 59_999)
    ]
    assert k[0].key != k[1].key == k[2].key
    assert k[1].reset_s == 60 and k[2].reset_s == 1
    assert match.reset_seconds(30 * 86400, start) == 30 * 86400 - (start // 1000) % (30 * 86400)


def test_bad_requests_are_refused() -> None:
    """Empty domain, no descriptors, oversized values and bad tenants are request errors."""
    c = cfg(PRECEDENCE)
    with pytest.raises(RequestError, match="domain must not be empty"):
        plan(c, "", [Descriptor((("k", "a"),))], 1, NOW)
    with pytest.raises(RequestError, match="descriptor list must not be empty"):
        plan(c, "d", [], 1, NOW)
    with pytest.raises(RequestError, match="AIQ_RLS_MAX_VALUE_LENGTH=512"):
        plan(c, "d", [Descriptor((("k", "a" * 2000),))], 1, NOW)
    with pytest.raises(RequestError, match=r"33 descriptors .* AIQ_RLS_MAX_DESCRIPTORS=32"):
        plan(c, "d", [Descriptor((("k", "a"),))] * 33, 1, NOW)
    linked = cfg(
        "domain: d\ndescriptors:\n  - key: tenant\n    ai_quota: {bucket: rpm, tenant: tenant}\n"
        "    rate_limit: {unit: minute, requests_per_unit: 5}\n"
    )
    with pytest.raises(RequestError, match="must name a tenant"):
        plan(linked, "d", [Descriptor((("tenant", "a}b{c"),))], 1, NOW)


def test_bucket_link_uses_the_ai_quota_key() -> None:
    """A linked rule counts in the tenant's ai-quota bucket key for the same window."""
    linked = cfg(
        "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: model\n"
        "        ai_quota: {bucket: tpm, tenant: tenant, model: model}\n"
        "        rate_limit: {unit: minute, requests_per_unit: 5}\n"
    )
    c = plan(linked, "d", [Descriptor((("tenant", "t1"), ("model", "m")))], 1, NOW).counted[0]
    assert c.key == f"aiq:{{t1}}:tpm:t:m:60:{NOW // 60_000}"


def test_keys_are_hash_tagged_and_escaped() -> None:
    """A counter key has one hash tag (the first entry's value, escaped) and no raw braces."""
    c = cfg(PRECEDENCE)
    key = plan(c, "d", [Descriptor((("k", "a{b}:c"),))], 1, NOW).counted[0].key
    assert key.startswith("aiq:{a%7Bb%7D%3Ac}:rls:d:")
    assert key.count("{") == 1 and key.count("}") == 1


def one_rule(limit: int, **flags: bool) -> RlsConfig:
    """A domain with one rule on key ``k`` (flags: shadow_mode, quota_mode)."""
    extra = "".join(f"    {k}: {str(v).lower()}\n" for k, v in flags.items())
    return cfg(
        f"domain: d\ndescriptors:\n  - key: k\n{extra}"
        f"    rate_limit: {{unit: minute, requests_per_unit: {limit}, name: r}}\n"
    )


def test_statuses_remaining_and_stats() -> None:
    """Within: remaining = limit - after; near-limit hits past 80%; over: remaining 0."""
    p = plan(one_rule(10), "d", [Descriptor((("k", "a"),))], 3, NOW)
    ok = decide(p, [6], True)
    s = ok.statuses[0]
    assert (ok.overall, s.code, s.limit_remaining) == (Code.OK, Code.OK, 1)
    assert s.rule is not None and s.reset_s > 0
    stats = ok.stats[0]
    assert (stats.total_hits, stats.within_limit, stats.near_limit, stats.over_limit) == (
        3,
        3,
        1,
        0,
    )
    over = decide(p, [9], False)
    assert over.overall is Code.OVER_LIMIT and over.statuses[0].limit_remaining == 0
    st2 = over.stats[0]
    assert (st2.over_limit, st2.near_limit, st2.within_limit) == (2, 1, 0)


def test_shadow_rule_answers_ok_and_counts_shadow_hits() -> None:
    """A shadow-mode rule over its limit answers OK and counts its shadow_mode hits."""
    p = plan(one_rule(2, shadow_mode=True), "d", [Descriptor((("k", "a"),))], 1, NOW)
    assert p.counted[0].mode == 0
    d = decide(p, [5], True)
    assert d.overall is Code.OK and d.statuses[0].code is Code.OK
    assert d.stats[0].shadow_mode == 1 and d.stats[0].over_limit == 1


def test_global_shadow_reports_over_but_answers_ok() -> None:
    """Global shadow mode: the descriptor says OVER_LIMIT, the overall answer is OK."""
    p = plan(one_rule(2), "d", [Descriptor((("k", "a"),))], 1, NOW, global_shadow=True)
    assert p.counted[0].mode == 0
    d = decide(p, [5], True)
    assert d.overall is Code.OK and d.statuses[0].code is Code.OVER_LIMIT
    assert d.global_shadow_hit


def test_quota_mode_refuses_only_when_all_quota_rules_are_over() -> None:
    """Quota-mode descriptors refuse the request only when every one of them is over."""
    c = cfg(
        """
domain: d
descriptors:
  - key: a
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: b
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"""
    )
    p = plan(c, "d", [Descriptor((("a", "x"),)), Descriptor((("b", "x"),))], 1, NOW)
    assert decide(p, [5, 0], True).overall is Code.OK
    assert decide(p, [5, 5], False).overall is Code.OVER_LIMIT


def test_headers_describe_the_closest_descriptor() -> None:
    """RateLimit-* headers describe the descriptor with least room, or the one over."""
    c = cfg(
        """
domain: d
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 10}
"""
    )
    p = plan(c, "d", [Descriptor((("a", "x"),)), Descriptor((("b", "x"),))], 1, NOW)
    names = ("L", "R", "T")
    h = dict(decide(p, [0, 5], True, headers=names).headers)
    assert h["L"] == "10" and h["R"] == "4"
    h2 = dict(decide(p, [100, 0], False, headers=names).headers)
    assert h2["L"] == "100" and h2["R"] == "0"
    assert decide(p, [0, 0], True).headers == ()


def test_fail_modes() -> None:
    """Redis gone: allow answers OK for all; deny answers OVER_LIMIT for counted ones."""
    p = plan(one_rule(5), "d", [Descriptor((("k", "a"),)), Descriptor((("z", "a"),))], 1, NOW)
    assert match.fail_open(p).overall is Code.OK
    closed = match.fail_closed(p)
    assert closed.overall is Code.OVER_LIMIT
    assert [s.code for s in closed.statuses] == [Code.OVER_LIMIT, Code.OK]


VALUES = st.text(alphabet="abx*", min_size=0, max_size=6)


@given(pattern=VALUES.filter(lambda v: "*" in v), value=st.text(alphabet="abx", max_size=8))
def test_wildcard_matches_like_glob(pattern: str, value: str) -> None:
    """A value pattern matches exactly what a glob of the same '*'s matches."""
    expected = fnmatch.fnmatchcase(value, pattern)
    assert match._wild(tuple(pattern.split("*")), value) is expected


@given(
    exact=st.booleans(),
    wildcard=st.booleans(),
    plain=st.booleans(),
    value=st.text(alphabet="abc", min_size=1, max_size=4),
)
def test_precedence_property(exact: bool, wildcard: bool, plain: bool, value: str) -> None:
    """For any set of siblings, the most specific one that matches applies."""
    lines = ["domain: d", "descriptors:"]
    if plain:
        lines += ["  - key: k", "    rate_limit: {unit: minute, requests_per_unit: 3}"]
    if wildcard:
        lines += [
            "  - key: k",
            f"    value: '{value[0]}*'",
            "    rate_limit: {unit: minute, requests_per_unit: 2}",
        ]
    if exact:
        lines += [
            "  - key: k",
            f"    value: '{value}'",
            "    rate_limit: {unit: minute, requests_per_unit: 1}",
        ]
    c = cfg("\n".join(lines) + "\n")
    got = limit_of(c, ("k", value))
    want = 1 if exact else 2 if wildcard else 3 if plain else None
    assert got == want


@given(
    limit=st.integers(min_value=0, max_value=20),
    hits=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=30),
)
def test_all_or_nothing_never_passes_the_limit(limit: int, hits: list[int]) -> None:
    """Replaying rls.lua's rule: admitted hits never take an enforced counter past its limit,
    and a request is refused exactly when its hits would."""
    c = one_rule(limit)
    value = 0
    for h in hits:
        p = plan(c, "d", [Descriptor((("k", "a"),), hits_addend=h)], 1, NOW)
        admitted = value + h <= limit
        d = decide(p, [value], admitted)
        assert (d.overall is Code.OK) is admitted
        if admitted:
            value += h
            assert d.statuses[0].limit_remaining == limit - value
        assert value <= limit
        s = d.stats[0]
        assert s.total_hits == h and s.within_limit + s.over_limit <= max(h, 0) + limit


def test_key_text_is_quoted() -> None:
    """Keys and values in a counter key are percent-encoded (no ':' or '|' from a value)."""
    c = cfg(PRECEDENCE)
    key = plan(c, "d", [Descriptor((("k", "x|y=z"),))], 1, NOW).counted[0].key
    assert re.search(r":rls:d:k=x%7Cy%3Dz:60:\d+$", key)


def test_matcher_is_sans_io() -> None:
    """extproc.rls.match imports no IO library and nothing above the core but the config."""
    import ast
    from pathlib import Path

    src = Path(match.__file__).read_text("utf-8")
    names: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    io = {"grpc", "redis", "aiohttp", "envoy", "prometheus_client", "structlog", "asyncio"}
    assert not {n.split(".")[0] for n in names} & io
    project = {n for n in names if n.startswith("extproc")}
    assert project <= {
        "extproc.core.keys",
        "extproc.core.rules",
        "extproc.rls.config",
        "extproc.rls.request",
    }


def test_huge_hits_and_entryless_override() -> None:
    """hits_addend past the cap is refused; with a cap past 2^32 it is clamped to 2^32 (still
    over every limit); an override without entries gets a key tagged by the domain."""
    c = cfg(PRECEDENCE)
    with pytest.raises(RequestError, match="AIQ_RLS_MAX_HITS_ADDEND=1000000"):
        plan(c, "d", [Descriptor((("k", "a"),), hits_addend=2**63)], 1, NOW)
    big = Caps(hits_addend=2**64)
    p = plan(c, "d", [Descriptor((("k", "a"),), hits_addend=2**63)], 1, NOW, caps=big)
    assert p.counted[0].hits == 2**32
    assert decide(p, [0], False).overall is Code.OVER_LIMIT
    allowing = cfg("allow_limit_override: true\n" + PRECEDENCE)
    bare = plan(allowing, "d", [Descriptor((), override=("minute", 3))], 1, NOW).counted[0]
    assert bare.key.startswith("aiq:{d}:rls:d::60:") and bare.limit == 3


CAPS = Caps(descriptors=2, entries=2, key_length=4, value_length=6, hits_addend=10)


@pytest.mark.parametrize(
    ("descriptors", "hits", "named"),
    [
        (
            [Descriptor((("k", "a"),))] * 3,
            1,
            "3 descriptors in one request, more than the cap AIQ_RLS_MAX_DESCRIPTORS=2",
        ),
        (
            [Descriptor((("k", "a"),) * 3)],
            1,
            "descriptor 0 has 3 entries, more than the cap AIQ_RLS_MAX_ENTRIES=2",
        ),
        (
            [Descriptor((("kkkkk", "a"),))],
            1,
            "descriptor 0 has a key of 5 characters, more than the cap AIQ_RLS_MAX_KEY_LENGTH=4",
        ),
        (
            [Descriptor((("k", "a"),)), Descriptor((("k", "a" * 7),))],
            1,
            "descriptor 1 has a "
            "value of 7 characters, more than the cap AIQ_RLS_MAX_VALUE_LENGTH=6",
        ),
        (
            [Descriptor((("k", "a"),))],
            11,
            "hits_addend 11 is more than the cap AIQ_RLS_MAX_HITS_ADDEND=10",
        ),
        (
            [Descriptor((("k", "a"),), hits_addend=11)],
            1,
            "descriptor 0's hits_addend 11 is more than the cap AIQ_RLS_MAX_HITS_ADDEND=10",
        ),
    ],
)
def test_each_cap_is_refused_by_name(descriptors: list[Descriptor], hits: int, named: str) -> None:
    """Every cap on what a request carries is refused with a message naming the cap; at the
    cap itself the request passes.  Unknown domains are checked the same way."""
    c = cfg(PRECEDENCE)
    for domain in ("d", "x"):  # "x": not in the config
        with pytest.raises(RequestError) as info:
            plan(c, domain, descriptors, hits, NOW, caps=CAPS)
        assert str(info.value) == named
    at_cap = [Descriptor((("k", "a" * 6), ("kkkk", "b")), hits_addend=10)] * 2
    assert len(plan(c, "d", at_cap, 10, NOW, caps=CAPS).items) == 2
    with pytest.raises(RequestError, match="the domain is 5 characters, more than the cap"):
        plan(c, "ddddd", [Descriptor((("k", "a"),))], 1, NOW, caps=CAPS)


def test_unknown_domain_counts_nothing_even_with_an_override() -> None:
    """An unknown domain (as envoyproxy/ratelimit) has no limit: an override there counts
    nothing and creates no key."""
    c = cfg("allow_limit_override: true\n" + PRECEDENCE)
    p = plan(c, "elsewhere", [Descriptor((("k", "v" * 100),), override=("year", 1))], 1, NOW)
    assert p.counted == [] and not p.known_domain
    assert all(i.rule is None for i in p.items)
    assert decide(p, [], True).overall is Code.OK


def test_override_applies_only_where_the_domain_allows_it() -> None:
    """Without allow_limit_override the override is ignored and the descriptor matched against
    the rules (counted, not refused); with it, the override's limit applies, labelled
    ``override`` whatever the caller's entries."""
    plain = cfg(PRECEDENCE)
    d = [
        Descriptor((("k", "exact"),), override=("second", 1)),
        Descriptor((("zz", "q"),), override=("day", 9)),
    ]
    p = plan(plain, "d", d, 1, NOW)
    assert p.overrides_ignored == 2
    assert p.items[0].rule is not None and p.items[0].rule.name == "exact"
    assert p.items[0].counted is not None and p.items[0].counted.limit == 1
    assert p.items[1].rule is None and p.items[1].counted is None  # unmatched: no limit
    allowing = cfg("allow_limit_override: true\n" + PRECEDENCE)
    q = plan(allowing, "d", d, 1, NOW)
    assert q.overrides_ignored == 0
    assert [i.counted.limit for i in q.items if i.counted] == [1, 9]
    stats = decide(q, [0, 0], True).stats
    assert {s.name for s in stats} == {match.OVERRIDE_RULE}


def test_unit_multiplier_makes_the_window_that_many_units() -> None:
    """``unit_multiplier: 5`` with unit minute: one counter per epoch-aligned 5 minutes, the
    reset counting down the 5 minutes, the answer's unit still minute."""
    c = cfg(
        "domain: d\ndescriptors:\n  - key: k\n"
        "    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 10}\n"
    )
    start = (NOW // 300_000 + 1) * 300_000
    k = [
        plan(c, "d", [Descriptor((("k", "a"),))], 1, t).counted[0]
        for t in (start - 1, start, start + 299_999, start + 300_000)
    ]
    assert k[0].key != k[1].key == k[2].key != k[3].key
    assert k[1].key.endswith(f":300:{start // 300_000}")
    assert (k[1].reset_s, k[2].reset_s) == (300, 1)
    assert k[1].expire_at_ms > start + 300_000
    rule = find(c.domains["d"], (("k", "a"),))
    assert rule is not None and (rule.rule.unit, rule.rule.window_s) == ("minute", 300)


LINKED = (
    "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: model\n"
    "        ai_quota: {bucket: tpm, tenant: tenant, model: model}\n"
    "        rate_limit: {unit: minute, requests_per_unit: 5}\n"
)


def test_link_charges_only_tenants_and_models_of_the_rules() -> None:
    """A linked rule charges the ai-quota bucket only for a tenant and a canonical model of the
    running rules; any other value is counted by the rule on its own RLS key."""
    c = cfg(LINKED)
    tenants, models = {"t1"}, {"m"}

    def key(tenant: str, model: str) -> str:
        d = [Descriptor((("tenant", tenant), ("model", model)))]
        return plan(c, "d", d, 1, NOW, tenants=tenants, models=models).counted[0].key

    assert key("t1", "m") == f"aiq:{{t1}}:tpm:t:m:60:{NOW // 60_000}"
    assert key("t2", "m") == f"aiq:{{t2}}:rls:d:tenant=t2|model=m:60:{NOW // 60_000}"
    assert key("t1", "alias") == f"aiq:{{t1}}:rls:d:tenant=t1|model=alias:60:{NOW // 60_000}"


def test_link_takes_the_tenant_the_tree_matched() -> None:
    """With the tenant key twice in a descriptor, the tenant is the entry at the link's level
    of the path (the one the tree matched), not another entry of the same key."""
    c = cfg(
        "domain: d\ndescriptors:\n  - key: org\n    descriptors:\n      - key: tenant\n"
        "        value: t1\n        ai_quota: {bucket: rpm, tenant: tenant}\n"
        "        rate_limit: {unit: minute, requests_per_unit: 5}\n"
    )
    d = [Descriptor((("org", "x"), ("tenant", "t1")))]
    assert plan(c, "d", d, 1, NOW).counted[0].key.startswith("aiq:{t1}:rpm:t:*:60:")
    # a descriptor whose second entry is another tenant does not match the rule at all
    assert plan(c, "d", [Descriptor((("org", "x"), ("tenant", "t2")))], 1, NOW).counted == []
