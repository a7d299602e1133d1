"""Levels through the real stack (Envoy + processor + Redis + simulator), driven by the openai
SDK with config/examples/hierarchy.yaml: organisation acme 6,000 tokens a minute; teams
research and product 4,000 each; each end user of research 1,500.

u1 is refused near 1,500 while u2 goes on; research is refused near 4,000; product then gets
only what the organisation has left: its stream is cut when the organisation runs out, and its
next request is refused naming the organisation.  Every counter is compared with the
simulator's own records of what it generated."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
import yaml

from extproc.records.model import UsageRecord
from extproc.stack import Stack
from tests.e2e.conftest import make_stack, usage_flags
from tests.e2e.test_streaming import MSG
from tests.helpers import request_ledgers

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "hierarchy.yaml"
TAG = "aiq:{@o.acme}"
EVERY = 64  # the example's charge_every_tokens: a lazy stream's overshoot per level


@pytest.fixture(scope="module")
def hstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(
        Path(tmp_path_factory.mktemp("levels")), rules=yaml.safe_load(EXAMPLE.read_text())
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rds(hstack: Stack) -> Iterator[redis.Redis]:
    client = redis.Redis(port=hstack.ports.redis, decode_responses=True)
    yield client
    client.close()


def oai(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=30)


def fresh_minute() -> None:
    """The example's windows are minutes: start the scenario with 40 s or more left in one."""
    into = time.time() % 60
    if into > 20:
        time.sleep(60 - into + 0.2)


def counter(rds: redis.Redis, scope: str) -> int:
    """The current minute's TPM counter of a level (``o``, ``g.research``, ``u.research.u1``)."""
    idx = int(time.time() * 1000) // 60_000
    return int(rds.get(f"{TAG}:tpm:{scope}:*:60:{idx}") or 0)


def all_settled(rds: redis.Redis, expect: int) -> None:
    """Wait until every request of the organisation has settled (their ledgers say so)."""
    deadline = time.monotonic() + 20
    while True:
        states = [rds.hget(k, "state") for k in request_ledgers(rds, TAG)]
        done = sum(1 for s in states if s in ("settled", "reclaimed"))
        if done >= expect and done == len(states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"settlements not applied: {states}")
        time.sleep(0.02)


def allowances_given_back(stack: Stack, rds: redis.Redis) -> None:
    """Wait until the processor holds no allowance of the organisation: the product's stream
    made its buckets busy enough to take some (local allowances, on by default), pre-debited
    in the counters; the processor gives back what nobody draws from within
    ``AIQ_ALLOWANCE_TTL_MS``.  What ``ai-quota usage`` shows (net of what the answering
    processor holds) then equals the counters themselves."""
    deadline = time.monotonic() + 15
    scopes = {"organisation=acme": "o", "team=research": "g.research", "team=product": "g.product"}
    while True:
        shown = usage(stack, "--organisation", "acme", admin=True)
        levels = {b["level"]: b["used"] for b in shown["buckets"] if b["metric"] == "tpm"}
        raw = {level: counter(rds, scope) for level, scope in scopes.items()}
        if levels == raw:
            return
        assert time.monotonic() < deadline, f"allowances never given back: {levels} {raw}"
        time.sleep(0.2)


def truth(stack: Stack, ids: set[str]) -> int:
    """Tokens the simulator counted (prompt + generated) for these requests."""
    recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
    mine = [r for r in recs if r["client_request_id"] in ids or r["request_id"] in ids]
    assert len(mine) == len(ids), (len(mine), len(ids))
    return sum(r["prompt_tokens_reported"] + r["tokens_sent"] for r in mine)


def ask(c: openai.OpenAI, rid: str, **kw: Any) -> Any:
    return c.chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=400, extra_headers={"x-request-id": rid}, **kw
    )


def test_example_levels_hold_and_name_themselves(hstack: Stack, rds: redis.Redis) -> None:
    research, product = oai(hstack, "sk-acme-research"), oai(hstack, "sk-acme-product")
    fresh_minute()
    ids: dict[str, set[str]] = {"research": set(), "product": set()}

    def go(c: openai.OpenAI, team: str, user: str | None) -> openai.RateLimitError | None:
        rid = f"lv-{uuid.uuid4().hex[:12]}"
        try:
            kw = {"user": user} if user else {}
            ask(c, rid, **kw)
        except openai.RateLimitError as exc:
            return exc
        ids[team].add(rid)
        return None

    # u1: refused near 1,500, naming the end user and its team
    err = None
    while err is None:
        err = go(research, "research", "u1")
    assert "end user u1 of team research" in str(err), err
    assert err.response.headers["x-aiquota-limit-level"] == "user=research/u1"
    all_settled(rds, len(ids["research"]))
    u1 = counter(rds, "u.research.u1")
    assert 1500 - 420 < u1 <= 1500
    # u2 goes on
    assert go(research, "research", "u2") is None
    # research: refused near 4,000, naming the team (u2, u3, ... each under their own 1,500)
    err, users = None, iter(["u2", "u2", "u3", "u3", "u3", "u4", "u4", "u4", "u5", "u5"])
    while err is None or "end user" in str(err):
        err = go(research, "research", next(users))
    assert "team research" in str(err) and "end user" not in str(err), err
    assert err.response.headers["x-aiquota-limit-level"] == "team=research"
    all_settled(rds, len(ids["research"]))
    team = counter(rds, "g.research")
    assert 4000 - 420 < team <= 4000
    assert team == truth(hstack, ids["research"])  # billed what the upstream generated

    # product: a stream runs until the organisation (not product's 4,000) runs out
    rid = f"lv-{uuid.uuid4().hex[:12]}"
    got, cut = 0, None
    try:
        for ch in product.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=4000,
            stream=True,
            extra_headers={"x-request-id": rid},
        ):
            if ch.choices and ch.choices[0].delta.content:
                got += 1
    except openai.APIError as exc:
        cut = exc
    ids["product"].add(rid)
    assert cut is not None, "the stream must be cut when the organisation runs out"
    assert "organisation acme" in str(cut), cut
    # only what the organisation had left (lazy: up to one charge batch past it), far from
    # product's own 4,000
    assert got <= 6000 - team + EVERY
    all_settled(rds, len(ids["research"]) + 1)
    allowances_given_back(hstack, rds)
    org = counter(rds, "o")
    assert 6000 - EVERY < org <= 6000 + EVERY  # lazy: at most one charge batch over
    assert org == counter(rds, "g.research") + counter(rds, "g.product")
    # the cut stream is billed what passed: never more than the upstream generated
    assert org - team <= truth(hstack, ids["product"])
    # product's next request is refused, naming the organisation
    err = go(product, "product", None)
    assert err is not None and "organisation acme" in str(err), err
    assert err.response.headers["x-aiquota-limit-level"] == "organisation=acme"
    assert err.response.headers["x-ratelimit-level-tokens"] == "organisation=acme"

    # ai-quota usage: a key reads its own levels (its end user's too), the admin any level
    mine = usage(hstack, "--key", "sk-acme-research", "--end-user", "u1")
    levels = {b["level"]: b["used"] for b in mine["buckets"] if b["metric"] == "tpm"}
    assert levels["organisation=acme"] == counter(rds, "o")
    assert levels["team=research"] == counter(rds, "g.research")
    assert levels["user=research/u1"] == counter(rds, "u.research.u1")
    assert (mine["organisation"], mine["team"]) == ("acme", "research")
    whole = usage(hstack, "--organisation", "acme", admin=True)
    levels = {b["level"]: b["used"] for b in whole["buckets"] if b["metric"] == "tpm"}
    assert levels == {
        "organisation=acme": counter(rds, "o"),
        "team=research": counter(rds, "g.research"),
        "team=product": counter(rds, "g.product"),
    }
    # research's distinct end users in this minute against its cap: a count, no ids (product
    # has no end-user limits: no such row)
    idx = int(time.time() * 1000) // 60_000
    distinct = rds.scard(f"{TAG}:users:g.research:*:60:{idx}")
    assert 3 <= distinct <= 5  # u1, u2, u3 were admitted; u4, u5 maybe
    (users,) = [b for b in whole["buckets"] if b["metric"] == "users"]
    assert (users["level"], users["used"], users["limit"]) == ("team=research", distinct, 1000)
    assert (users["unit"], users["period"], users["remaining"]) == (
        "end users",
        "minute",
        1000 - distinct,
    )
    assert not any(b["level"].startswith("user=") for b in whole["buckets"])
    assert [b["used"] for b in mine["buckets"] if b["metric"] == "users"] == [distinct]
    denied = usage(hstack, "--key", "sk-acme-product", "--team", "research", check=False)
    assert "PERMISSION_DENIED" in denied["error"]

    # usage records carry the level ids
    want = ids["research"] | ids["product"]
    deadline = time.monotonic() + 15  # the recorder writes in the background, in batches
    recs: dict[str, UsageRecord] = {}
    while len(recs) < len(want):
        assert time.monotonic() < deadline, f"records: {len(recs)} of {len(want)}"
        for _, f in rds.xrange("aiq:usage") or []:
            rec = UsageRecord.from_fields(f or {})
            if rec.request_id in want:
                recs[rec.request_id] = rec
        time.sleep(0.05)
    assert {(r.organisation, r.team) for r in recs.values()} == {
        ("acme", "research"),
        ("acme", "product"),
    }
    assert {r.end_user for r in recs.values() if r.team == "research"} >= {"u1", "u2", "u3"}
    assert sum(r.input_tokens + r.output_tokens for r in recs.values()) == counter(rds, "o")


def usage(stack: Stack, *flags: str, admin: bool = False, check: bool = True) -> dict[str, Any]:
    """``ai-quota usage ... --json`` against the stack (``error``: its stderr when it fails)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc",
            "usage",
            *flags,
            "--json",
            *usage_flags(stack, admin=admin),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if out.returncode != 0:
        assert not check, out.stderr
        return {"error": out.stderr}
    return dict(orjson.loads(out.stdout))


# -- money budgets at two levels ------------------------------------------------------------

# $1,000 per million input tokens, $2,000 per million output tokens (micro-dollars per token:
# 1,000 and 2,000): a budget of $1.00 pays for about 500 output tokens.
PRICING = {"currency": "USD", "input": 1000, "output": 2000}


def money_rules() -> dict[str, Any]:
    return {
        "version": 1,
        "charging": {"charge_every_tokens": 16},
        "models": {
            "sim-small": {
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 4096,
                "pricing": PRICING,
            }
        },
        "plans": {"big": {"limits": [{"per": "day", "rpm": 1000, "tpm": 1_000_000}]}},
        "organisations": {
            "money": {
                "limits": [{"per": "day", "budget": 1.0}],
                "charging": {"streaming": "strict"},  # never a cent over, at any level of it
            }
        },
        "teams": {
            "ma": {"organisation": "money", "limits": [{"per": "day", "budget": 0.4}]},
            "mb": {"organisation": "money"},
        },
        "tenants": {
            "mt": {
                "plan": "big",
                "keys": [
                    {"name": "ka", "plaintext": "sk-m-a", "team": "ma"},
                    {"name": "kb", "plaintext": "sk-m-b", "team": "mb"},
                ],
            }
        },
    }


@pytest.fixture(scope="module")
def mstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(Path(tmp_path_factory.mktemp("money-levels")), rules=money_rules())
    yield s
    s.stop()


def spent(rds: redis.Redis, scope: str) -> int:
    """Micro-dollars of a level's daily budget counter (``o``, ``g.ma``)."""
    return sum(int(rds.get(k) or 0) for k in rds.scan_iter(f"aiq:{{@o.money}}:cost.USD:{scope}:*"))


def stream_until_cut(c: openai.OpenAI) -> tuple[int, openai.APIError | None]:
    got = 0
    try:
        for ch in c.chat.completions.create(
            model="sim-small", messages=MSG, max_tokens=1000, stream=True
        ):
            if ch.choices and ch.choices[0].delta.content:
                got += 1
    except openai.APIError as exc:
        return got, exc
    return got, None


def test_money_budgets_at_two_levels_hold_strictly(mstack: Stack) -> None:
    """A team's budget cuts its stream, naming the team; the organisation's cuts another
    team's, naming the organisation; strict (the organisation asks for it): neither is ever
    over, and each is used to within one charge batch."""
    rds = redis.Redis(port=mstack.ports.redis, decode_responses=True)
    a, b = oai(mstack, "sk-m-a"), oai(mstack, "sk-m-b")
    got, err = stream_until_cut(a)
    assert err is not None and "team ma" in str(err) and "budget of 0.40 USD" in str(err), err
    assert 100 < got < 200
    deadline = time.monotonic() + 20
    while any(rds.hget(k, "state") != "settled" for k in request_ledgers(rds, "aiq:{@o.money}")):
        assert time.monotonic() < deadline, "settlement never came"
        time.sleep(0.02)
    team = spent(rds, "g.ma")
    assert 400_000 - 16 * 2_000 < team <= 400_000  # strict: never over
    got, err = stream_until_cut(b)
    assert err is not None and "organisation money" in str(err), err
    deadline = time.monotonic() + 20
    while any(rds.hget(k, "state") != "settled" for k in request_ledgers(rds, "aiq:{@o.money}")):
        assert time.monotonic() < deadline, "settlement never came"
        time.sleep(0.02)
    org = spent(rds, "o")
    assert 1_000_000 - 16 * 2_000 < org <= 1_000_000
    assert spent(rds, "g.ma") == team  # team ma was not charged for team mb's stream
    with pytest.raises(openai.RateLimitError) as info:
        b.chat.completions.create(model="sim-small", messages=MSG, max_tokens=10)
    assert info.value.code == "budget_exceeded"
    assert "organisation money" in str(info.value)
    assert info.value.response.headers["x-aiquota-limit-level"] == "organisation=money"
    rds.close()


# -- strict: never over at any level, 64 streams at once ------------------------------------


def strict_rules() -> dict[str, Any]:
    return {
        "version": 1,
        "charging": {"charge_every_tokens": 16},
        "models": {
            "sim-small": {
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 4096,
            }
        },
        "plans": {"big": {"limits": [{"per": "day", "rpm": 100000, "tpm": 4500}]}},
        "organisations": {
            "so": {
                "limits": [{"per": "day", "tpm": 5000}],
                "charging": {"streaming": "strict"},
            }
        },
        "teams": {
            f"st{i}": {
                "organisation": "so",
                "limits": [{"per": "day", "tpm": 3000}],
                "end_users": {"limits": [{"per": "day", "tpm": 1200}], "per": "day"},
            }
            for i in (1, 2)
        },
        "tenants": {
            "s": {
                "plan": "big",
                "keys": [
                    {"name": f"k{i}", "plaintext": f"sk-strict-{i}", "team": f"st{i}"}
                    for i in (1, 2)
                ],
            }
        },
    }


@pytest.fixture(scope="module")
def sstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(Path(tmp_path_factory.mktemp("strict-levels")), rules=strict_rules())
    yield s
    s.stop()


def test_strict_levels_are_never_over_with_64_concurrent_streams(sstack: Stack) -> None:
    """64 streams at once, over two teams and four end users (two per team), each asking far
    more than any level allows: once all are settled, no counter of any level (the
    organisation, each team, each end user, the tenant) is over its limit, and the tokens the
    clients received fit in each."""
    from concurrent.futures import ThreadPoolExecutor

    rds = redis.Redis(port=sstack.ports.redis, decode_responses=True)
    got: dict[tuple[int, str], int] = {}

    def one(i: int) -> tuple[tuple[int, str], int]:
        team, user = 1 + i % 2, f"u{(i // 2) % 2}"
        c = oai(sstack, f"sk-strict-{team}")
        n = 0
        try:
            for ch in c.chat.completions.create(
                model="sim-small", messages=MSG, max_tokens=400, stream=True, user=user
            ):
                if ch.choices and ch.choices[0].delta.content:
                    n += 1
        except openai.APIError:
            pass  # refused or cut: what it received still counts below
        return (team, user), n

    with ThreadPoolExecutor(max_workers=64) as pool:
        for who, n in pool.map(one, range(64)):
            got[who] = got.get(who, 0) + n
    deadline = time.monotonic() + 30
    while any(
        rds.hget(k, "state") not in ("settled", "reclaimed")
        for k in request_ledgers(rds, "aiq:{@o.so}")
    ):
        assert time.monotonic() < deadline, "settlements not applied"
        time.sleep(0.05)

    def used(scope: str) -> int:
        return sum(int(rds.get(k) or 0) for k in rds.scan_iter(f"aiq:{{@o.so}}:tpm:{scope}:*"))

    limits = {"o": 5000, "t.s": 4500, "g.st1": 3000, "g.st2": 3000}
    limits |= {f"u.st{t}.u{u}": 1200 for t in (1, 2) for u in (0, 1)}
    over = {scope: used(scope) - cap for scope, cap in limits.items() if used(scope) > cap}
    assert over == {}, f"over their limits: {over}"
    assert used("o") > 5000 - 64 * 16  # the organisation was used up (the streams were cut)
    assert sum(got.values()) <= 5000
    for t in (1, 2):
        assert got.get((t, "u0"), 0) + got.get((t, "u1"), 0) <= 3000
        for u in ("u0", "u1"):
            assert got.get((t, u), 0) <= 1200
    rds.close()
