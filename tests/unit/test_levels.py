"""Levels (organisation -> team -> tenant/key -> end user): the rules file compiles them into
limits of each key, every key of one request shares one Redis Cluster slot, refusals and
headers name the level, and the admission rule holds over random hierarchies (Hypothesis)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from extproc.clock import FakeClock
from extproc.config.load import ConfigError, load_config, load_config_text
from extproc.config.runtime import RuntimeConfig
from extproc.core import admission_plan, end_users
from extproc.core.admission_plan import admission_charges, compute_cost, refusal
from extproc.core.keys import ledger_key, open_key, user_segment, windowed
from extproc.core.rules import Charging
from extproc.limiter.base import AdmitCall
from extproc.limiter.memory import MemoryLimiter
from tests.levels_support import check_levels_hold

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "hierarchy.yaml"
NOW = 1_700_000_000_000  # also the in-memory limiter's clock (FakeClock): keys never expire


def rules(**top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "models": {
            "m": {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 4096},
        },
        "plans": {"p": {"limits": [{"per": "minute", "tpm": 100000}]}},
        "organisations": {"acme": {"limits": [{"per": "minute", "tpm": 6000}]}},
        "teams": {
            "research": {
                "organisation": "acme",
                "limits": [{"per": "minute", "tpm": 4000}],
                "end_users": {"limits": [{"per": "minute", "tpm": 1500}], "max_users": 2},
            },
            "product": {"organisation": "acme", "limits": [{"per": "minute", "tpm": 4000}]},
        },
        "tenants": {
            "acme": {
                "plan": "p",
                "keys": [
                    {"name": "r", "plaintext": "sk-r", "team": "research"},
                    {"name": "p", "plaintext": "sk-p", "team": "product"},
                ],
            },
            "solo": {"plan": "p", "keys": [{"name": "s", "plaintext": "sk-s"}]},
        },
    }
    doc.update(top)
    return doc


def compile_doc(doc: dict[str, Any]) -> RuntimeConfig:
    return load_config_text(yaml.safe_dump(doc))


def test_the_example_compiles_into_levels_of_each_key() -> None:
    cfg = load_config(EXAMPLE)
    acme = cfg.tenants["acme"]
    assert acme.organisation == "acme" and acme.slot == "@o.acme/acme"
    research = {
        (lim.scope, lim.owner, lim.metric, lim.limit) for lim in acme.limits_for("research")
    }
    assert ("organisation", "acme", "tpm", 6000) in research
    assert ("team", "research", "tpm", 4000) in research
    assert ("user", "research", "tpm", 1500) in research
    assert ("team", "research", "users", 1000) in research
    product = {(lim.scope, lim.owner, lim.limit) for lim in acme.limits_for("product")}
    assert ("team", "product", 4000) in product and ("organisation", "acme", 6000) in product
    assert not any(lim.scope == "user" for lim in acme.limits_for("product"))
    assert cfg.organisations == {"acme": ("product", "research")}


def test_every_key_of_a_request_is_in_the_organisation_slot() -> None:
    """Tenant, key, team, organisation and end-user counters, the ledger and the open set:
    one hash tag, the organisation's; a tenant outside any organisation keeps its own."""
    cfg = compile_doc(rules())
    acme = cfg.tenants["acme"]
    bs = windowed("aiq", acme.slot, "r", acme.limits_for("r"), NOW, user="u1")
    led = ledger_key("aiq", acme.slot, "req-1")
    keys = [b.key for b in bs] + [b.prev_key for b in bs if b.prev_key] + [led, open_key(led)]
    assert {key_slot(k.encode()) for k in keys} == {key_slot(b"{@o.acme}")}
    assert all(k.startswith("aiq:{@o.acme}:") for k in keys)
    assert len(set(keys)) == len(keys)
    assert any(":tpm:u.research.u1:" in k for k in keys)
    assert any(":tpm:t.acme:" in k for k in keys)
    solo = cfg.tenants["solo"]
    (b,) = windowed("aiq", solo.slot, "s", solo.limits_for("s"), NOW)
    assert b.key == f"aiq:{{solo}}:tpm:t:*:60:{NOW // 60_000}"  # unchanged: no rename
    assert ledger_key("aiq", solo.slot, "x") == "aiq:{solo}:req:x"


def test_end_user_ids_are_bounded_in_keys() -> None:
    assert user_segment("u1") == "u1"
    odd = user_segment("a:b}{c" + "x" * 500)
    assert odd.startswith("h") and len(odd) == 25 and ":" not in odd and "{" not in odd
    assert user_segment("a" * 65) != user_segment("a" * 66)


def test_end_user_sources() -> None:
    assert end_users.from_body("chat", {"user": "u1"}) == "u1"
    assert end_users.from_body("messages", {"metadata": {"user_id": "u2"}}) == "u2"
    assert end_users.from_body("messages", {"user": "x"}) == ""
    assert end_users.from_body("chat", {"user": 5}) == ""
    hint = end_users.before_body(["header", "body"], {"x-end-user": "h1"}, header="x-end-user")
    assert hint == ("h1", False)
    assert end_users.resolve(*hint, "chat", {"user": "b"}) == "h1"
    hint = end_users.before_body(["body", "header"], {"x-end-user": "h1"}, header="x-end-user")
    assert end_users.resolve(*hint, "chat", {"user": "b"}) == "b"
    assert end_users.resolve(*hint, "chat", {}) == "h1"
    jwt = end_users.before_body(
        ["jwt"], {}, header="x", jwt_payload={"ctx": {"uid": 7}}, jwt_claim="ctx.uid"
    )
    assert jwt == ("7", False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teams": {"t": {"organisation": "nope"}}}, "unknown organisation 'nope'"),
        (
            {
                "tenants": {
                    "x": {"plan": "p", "team": "ghost", "keys": [{"name": "k", "plaintext": "sk"}]}
                }
            },
            "unknown team 'ghost'",
        ),
        (
            {"organisations": {"acme": {"limits": [{"scope": "key", "tpm": 5}]}}},
            "'scope' does not apply",
        ),
        (
            {
                "organisations": {"a": {}, "b": {}},
                "teams": {"ta": {"organisation": "a"}, "tb": {"organisation": "b"}},
                "tenants": {
                    "x": {
                        "plan": "p",
                        "keys": [
                            {"name": "k1", "plaintext": "sk-1", "team": "ta"},
                            {"name": "k2", "plaintext": "sk-2", "team": "tb"},
                        ],
                    }
                },
            },
            "more than one organisation",
        ),
    ],
)
def test_bad_levels_are_refused_with_a_clear_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_doc(rules(**change))


def test_a_refusal_names_the_level_and_headers_the_binding_one() -> None:
    cfg = compile_doc(rules())
    acme = cfg.tenants["acme"]
    bs = windowed("aiq", acme.slot, "p", acme.limits_for("p"), NOW, user="")
    cost = compute_cost(
        input_tokens=100, per_choice_max=400, n=1, stream=False, charging=Charging()
    )
    # the organisation holds 5,800 of 6,000; product's team 1,000 of 4,000
    values = tuple(5800 if b.limit.scope == "organisation" else 1000 for b in bs)
    err = refusal(bs, values, cost, NOW, tenant="acme", model="m")
    assert "organisation acme" in err.message and err.level == "organisation=acme"
    assert ("x-ratelimit-level-tokens", "organisation=acme") in err.headers.as_pairs()
    assert ("x-ratelimit-remaining-tokens", "200") in err.headers.as_pairs()


def test_a_new_end_user_beyond_the_team_cap_is_refused_naming_the_cap() -> None:
    cfg = compile_doc(rules())
    acme = cfg.tenants["acme"]
    lim = MemoryLimiter(FakeClock(NOW))
    cost = compute_cost(input_tokens=10, per_choice_max=10, n=1, stream=False, charging=Charging())
    now = NOW

    async def ask(user: str, n: int) -> Any:
        bs = windowed("aiq", acme.slot, "r", acme.limits_for("r"), now, user=user)
        led = ledger_key("aiq", acme.slot, f"{user}-{n}")
        res = await lim.admit(
            AdmitCall(
                led,
                admission_charges(bs, cost),
                tpm_charged=20,
                count_refused=False,
                ledger_ttl_ms=60_000,
            )
        )
        return bs, res

    async def run() -> None:
        for i, u in enumerate(["u1", "u2", "u1", "u2"]):
            _, res = await ask(u, i)
            assert res.admitted, u
        bs, res = await ask("u3", 9)
        assert not res.admitted
        err = refusal(list(bs), res.values, cost, now, tenant="acme", model="m")
        assert err.metric == "users" and err.code == "end_users_limit_exceeded"
        assert "team research" in err.message and "2 distinct end users per minute" in err.message

    asyncio.run(run())


# -- the admission rule over random hierarchies ---------------------------------------------

LIMIT = st.integers(min_value=50, max_value=2000)


@st.composite
def hierarchy(draw: st.DrawFn) -> dict[str, Any]:
    teams = draw(st.integers(min_value=1, max_value=3))
    doc = rules(
        organisations={"o": {"limits": [{"per": "minute", "tpm": draw(LIMIT)}]}},
        teams={
            f"t{i}": {
                "organisation": "o",
                "limits": [{"per": "minute", "tpm": draw(LIMIT)}],
                **(
                    {"end_users": {"limits": [{"per": "minute", "tpm": draw(LIMIT)}]}}
                    if draw(st.booleans())
                    else {}
                ),
            }
            for i in range(teams)
        },
        tenants={
            "x": {
                "plan": "p",
                "keys": [
                    {"name": f"k{i}", "plaintext": f"sk-{i}", "team": f"t{i}"} for i in range(teams)
                ],
            }
        },
    )
    doc["plans"]["p"]["limits"] = [{"per": "minute", "tpm": draw(LIMIT)}]
    return doc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=hierarchy(),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["u1", "u2", "u3"]), st.integers(1, 600)),
        min_size=1,
        max_size=40,
    ),
)
def test_no_level_is_ever_over_and_a_refusal_names_a_level_really_out(
    doc: dict[str, Any], requests: list[tuple[int, str, int]]
) -> None:
    """Whole charges at admission (the strict path's rule): after any sequence, no counter of
    any level is over its limit, and each refusal names a level whose counter plus the
    request's charge is over its limit."""
    cfg = compile_doc(doc)
    tenant = cfg.tenants["x"]
    teams = len(doc["teams"])
    lim = MemoryLimiter(FakeClock(NOW))

    async def counter(key: str) -> int | None:
        return lim.counter(key)

    async def run() -> None:
        await check_levels_hold(
            lim,
            tenant,
            [(f"k{k % teams}", user, tokens) for k, user, tokens in requests],
            prefix="aiq",
            now=NOW,
            counter=counter,
        )

    asyncio.run(run())


def test_admission_plan_keeps_its_buckets_for_signature() -> None:
    """buckets_for passes the end user through (a user-scope limit's bucket names it)."""
    cfg = compile_doc(rules())
    acme = cfg.tenants["acme"]
    bs = admission_plan.buckets_for(
        prefix="aiq",
        tenant=acme.slot,
        key_name="r",
        model="m",
        limits=acme.limits_for("r"),
        now_ms=NOW,
        user="zed",
    )
    assert any(":u.research.zed:" in b.key for b in bs)


# -- RLS descriptors naming a level ---------------------------------------------------------

RLS_LEVELS = (
    "domain: d\ndescriptors:\n"
    "  - key: org\n    ai_quota: {bucket: tpm, organisation: org}\n"
    "    rate_limit: {unit: minute, requests_per_unit: 6000}\n"
    "  - key: team\n    ai_quota: {bucket: tpm, team: team}\n"
    "    rate_limit: {unit: minute, requests_per_unit: 4000}\n"
    "  - key: tenant\n    ai_quota: {bucket: tpm, tenant: tenant}\n"
    "    rate_limit: {unit: minute, requests_per_unit: 100000}\n"
)


def test_rls_descriptors_naming_a_level_share_the_gateways_counters() -> None:
    """``ai_quota: {organisation: org}`` (or ``team:``) counts in the very counter the gateway's
    admissions charge for that level; a tenant inside an organisation is linked in its
    organisation's slot; an unknown organisation is counted on the rule's own key."""
    from extproc.rls.load import compile_domains
    from extproc.rls.match import plan
    from extproc.rls.parse import parse_text
    from extproc.rls.request import Descriptor

    cfg = load_config(EXAMPLE)
    acme = cfg.tenants["acme"]
    gateway = {
        (b.limit.scope, b.limit.owner): b.key
        for b in windowed("aiq", acme.slot, "research", acme.limits_for("research"), NOW)
        if b.metric == "tpm"
    }
    rls = compile_domains([parse_text(RLS_LEVELS, "levels.yaml")])

    def key(entry: str, value: str) -> str:
        p = plan(
            rls,
            "d",
            [Descriptor(((entry, value),))],
            1,
            NOW,
            tenants=cfg.tenants,
            models=cfg.models,
            organisations=cfg.organisations,
        )
        return p.counted[0].key

    assert key("org", "acme") == gateway[("organisation", "acme")]
    assert key("team", "research") == gateway[("team", "research")]
    assert key("tenant", "acme") == gateway[("tenant", "")]
    assert key("org", "nope").startswith("aiq:{nope}:rls:d:")
    with pytest.raises(Exception, match="one of tenant, organisation or team"):
        parse_text(
            RLS_LEVELS.replace(
                "{bucket: tpm, team: team}", "{bucket: tpm, team: team, tenant: team}"
            ),
            "x.yaml",
        )
