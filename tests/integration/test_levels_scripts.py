"""Levels on every backend (the in-memory limiter, Redis, a three-node Redis Cluster): one
admission call over the organisation, team, tenant and end-user counters of the example rules
(one Cluster slot: the call would fail with CROSSSLOT otherwise), all or nothing, and a team's
cap on distinct end users (a set: a known end user passes, a new one beyond the cap is
refused, nothing charged)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from extproc.config.load import load_config
from extproc.core.admission_plan import admission_charges, compute_cost, refusal
from extproc.core.keys import ledger_key, windowed
from extproc.core.rules import Charging
from extproc.limiter.base import AdmitCall
from tests.levels_support import check_levels_hold
from tests.limiters import Backend

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "hierarchy.yaml"


async def test_levels_admit_in_one_call_and_cap_end_users(backend: Backend) -> None:
    cfg = load_config(EXAMPLE)
    acme = cfg.tenants["acme"]
    prefix = f"lv{uuid.uuid4().hex[:6]}"  # fresh counters on a shared server
    now = int(time.time() * 1000)
    lim = backend.limiter

    async def ask(key: str, user: str, tokens: int) -> tuple[list, object]:  # type: ignore[type-arg]
        bs = windowed(prefix, acme.slot, key, acme.limits_for(key), now, user=user)
        cost = compute_cost(
            input_tokens=tokens, per_choice_max=0, n=1, stream=False, charging=Charging()
        )
        led = ledger_key(prefix, acme.slot, uuid.uuid4().hex)
        res = await lim.admit(
            AdmitCall(
                led,
                admission_charges(bs, cost),
                tpm_charged=tokens,
                count_refused=False,
                ledger_ttl_ms=60_000,
            )
        )
        if not res.admitted:
            err = refusal(bs, res.values, cost, now, tenant="acme", model="sim-small")
            return bs, err
        return bs, res

    # u1 of research: 1,500 per minute
    _, r = await ask("research", "u1", 1400)
    assert getattr(r, "admitted", False)
    _, r = await ask("research", "u1", 200)
    assert getattr(r, "level", "") == "user=research/u1", r
    # u2 goes on; then research's 4,000 is what refuses
    for user in ("u2", "u3"):
        _, r = await ask("research", user, 1300)
        assert getattr(r, "admitted", False), r
    _, r = await ask("research", "u4", 200)  # research holds 4,000
    assert getattr(r, "level", "") == "team=research", r
    # product: only what the organisation has left (6,000 - 4,000)
    _, r = await ask("product", "", 1900)
    assert getattr(r, "admitted", False), r
    bs, r = await ask("product", "", 200)
    assert getattr(r, "level", "") == "organisation=acme", r
    assert "organisation acme" in getattr(r, "message", "")
    org = next(b for b in bs if b.limit.scope == "organisation")
    assert await backend.probe.counter(org.key) == 5900  # all or nothing: the refusals added 0


async def test_a_team_caps_its_distinct_end_users(backend: Backend) -> None:
    cfg = load_config(EXAMPLE)
    acme = cfg.tenants["acme"]
    # the example's cap is 1,000 a minute: a copy of its research team's limits with cap 2
    import dataclasses

    limits = tuple(
        dataclasses.replace(x, limit=2) if x.metric == "users" else x
        for x in acme.limits_for("research")
    )
    prefix = f"lu{uuid.uuid4().hex[:6]}"
    now = int(time.time() * 1000)
    cost = compute_cost(input_tokens=1, per_choice_max=0, n=1, stream=False, charging=Charging())

    async def ask(user: str) -> bool:
        bs = windowed(prefix, acme.slot, "research", limits, now, user=user)
        res = await backend.limiter.admit(
            AdmitCall(
                ledger_key(prefix, acme.slot, uuid.uuid4().hex),
                admission_charges(bs, cost),
                tpm_charged=1,
                count_refused=False,
                ledger_ttl_ms=60_000,
            )
        )
        if not res.admitted:
            err = refusal(bs, res.values, cost, now, tenant="acme", model="sim-small")
            assert err.metric == "users" and err.level == "team=research", err.message
        return res.admitted

    assert [await ask(u) for u in ("a", "b", "a", "b", "c", "a")] == [
        True,
        True,
        True,
        True,
        False,
        True,
    ]
    # what GetUsage shows against the cap: the set's size (the limiter reads a count, never
    # the members); a refused new end user was not added
    users = next(
        b for b in windowed(prefix, acme.slot, "research", limits, now) if b.kind == "users"
    )
    assert await backend.limiter.count_members([users.key]) == [2]
    assert await backend.limiter.count_members([users.key.replace(":60:", ":3600:")]) == [0]


async def test_concurrency_weighted_and_shadow_limits_at_levels(backend: Backend) -> None:
    """Any limit kind at a level: an organisation's concurrency slot and a team's weighted
    tokens refuse naming their level; a shadow limit at a level counts and never refuses."""
    import yaml

    from extproc.config.load import load_config_text

    doc: dict[str, Any] = {
        "version": 1,
        "models": {"m": {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 100}},
        "plans": {"p": {"limits": [{"per": "minute", "tpm": 10**9}]}},
        "organisations": {
            "o": {"limits": [{"concurrency": 1}, {"per": "minute", "tpm": 5, "shadow": True}]}
        },
        "teams": {
            "t": {
                "organisation": "o",
                "limits": [
                    {"per": "day", "weighted_tokens": 100, "weights": {"input": 2, "output": 1}}
                ],
            }
        },
        "tenants": {
            "x": {"plan": "p", "team": "t", "keys": [{"name": "k", "plaintext": "sk-lv-x"}]}
        },
    }
    cfg = load_config_text(yaml.safe_dump(doc))
    x = cfg.tenants["x"]
    prefix = f"lk{uuid.uuid4().hex[:6]}"
    now = int(time.time() * 1000)

    async def ask(tokens: int, lease: bool) -> object:
        bs = windowed(prefix, x.slot, "k", x.limits_for("k"), now, lease_ms=30_000)
        cost = compute_cost(
            input_tokens=tokens, per_choice_max=0, n=1, stream=False, charging=Charging()
        )
        res = await backend.limiter.admit(
            AdmitCall(
                ledger_key(prefix, x.slot, uuid.uuid4().hex),
                admission_charges(bs, cost),
                tpm_charged=tokens,
                count_refused=False,
                ledger_ttl_ms=60_000,
                now_ms=now,
                lease_until_ms=now + 30_000 if lease else 0,
            )
        )
        if res.admitted:
            return res
        return refusal(bs, res.values, cost, now, tenant="x", model="m")

    first = await ask(10, True)  # 20 weighted of 100; over the shadow 5 tokens: still admitted
    assert getattr(first, "admitted", False), first
    err = await ask(10, True)  # the organisation's one slot is taken
    assert getattr(err, "level", "") == "organisation=o" and getattr(err, "metric", "") == (
        "concurrency"
    ), err
    assert "organisation o" in getattr(err, "message", "")
    doc["organisations"]["o"]["limits"] = [{"per": "minute", "tpm": 5, "shadow": True}]
    cfg = load_config_text(yaml.safe_dump(doc))
    x = cfg.tenants["x"]
    for _ in range(4):  # 20 more weighted each: 100 reached by the 4th
        assert getattr(await ask(10, False), "admitted", False)
    err = await ask(10, False)
    assert getattr(err, "level", "") == "team=t" and getattr(err, "metric", "") == "cost", err
    assert "weighted tokens per day" in getattr(err, "message", "")


async def test_random_hierarchies_never_over_and_refusals_name_a_level_out(
    backend: Backend,
) -> None:
    """The Hypothesis property of tests/unit/test_levels.py on the real scripts: random
    hierarchies (1-3 teams, end-user limits or not, random limits) and random requests
    (seeded: reproducible); whole charges at admission; no counter of any level ends over its
    limit and every refusal names a level whose counter plus the charge is over."""
    import random

    import yaml

    from extproc.config.load import load_config_text

    for seed in range(12):
        rnd = random.Random(seed)
        teams = rnd.randint(1, 3)
        doc: dict[str, Any] = {
            "version": 1,
            "models": {"m": {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 10}},
            "plans": {"p": {"limits": [{"per": "minute", "tpm": rnd.randint(50, 2000)}]}},
            "organisations": {"o": {"limits": [{"per": "minute", "tpm": rnd.randint(50, 2000)}]}},
            "teams": {
                f"t{i}": {
                    "organisation": "o",
                    "limits": [{"per": "minute", "tpm": rnd.randint(50, 2000)}],
                    **(
                        {"end_users": {"limits": [{"per": "minute", "tpm": rnd.randint(50, 900)}]}}
                        if rnd.random() < 0.5
                        else {}
                    ),
                }
                for i in range(teams)
            },
            "tenants": {
                "x": {
                    "plan": "p",
                    "keys": [
                        {"name": f"k{i}", "plaintext": f"sk-{i}", "team": f"t{i}"}
                        for i in range(teams)
                    ],
                }
            },
        }
        x = load_config_text(yaml.safe_dump(doc)).tenants["x"]
        prefix = f"lr{uuid.uuid4().hex[:6]}"
        if time.time() % 60 > 55:  # the counters of a seed live in one minute's window
            time.sleep(60 - time.time() % 60 + 0.1)
        requests = [
            (f"k{rnd.randrange(teams)}", rnd.choice("abc"), rnd.randint(1, 600)) for _ in range(30)
        ]
        await check_levels_hold(
            backend.limiter,
            x,
            requests,
            prefix=prefix,
            now=int(time.time() * 1000),
            counter=backend.probe.counter,
            why=seed,
        )
