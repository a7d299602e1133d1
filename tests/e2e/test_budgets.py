"""Budgets and policies on the real stack (Envoy + processor + Redis + simulator), driven by the
openai SDK: a money budget cut mid-stream, a concurrency limit, shadow limits, and a monthly
budget across a month boundary (the processor's clock shifted, not slept through)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis

from extproc.records.model import UsageRecord
from extproc.stack import Stack
from tests.e2e.conftest import make_stack, usage_flags
from tests.e2e.test_streaming import ENGINE_PROMPT, MSG
from tests.helpers import e2e_rules, settled

pytestmark = pytest.mark.e2e

# $1,000 per million input tokens and $2,000 per million output tokens: a token costs
# 1,000 / 2,000 micro-dollars, so a $1.00 budget pays for a few hundred tokens.
PRICING = {"currency": "USD", "input": 1000, "cached_input": 100, "output": 2000}
HOUR = "day"  # long windows: the suite rarely straddles a boundary


def budget_rules(**top: Any) -> dict[str, Any]:
    rules = e2e_rules(
        {
            "b-lazy": {"plan": "usd1", "keys": [{"name": "bl", "plaintext": "sk-b-lazy"}]},
            "b-strict": {
                "plan": "usd1strict",
                "keys": [{"name": "bs", "plaintext": "sk-b-strict"}],
            },
            "b-conc": {"plan": "conc2", "keys": [{"name": "bc", "plaintext": "sk-b-conc"}]},
            "b-shadow": {"plan": "shadow", "keys": [{"name": "bsh", "plaintext": "sk-b-shadow"}]},
            "b-month": {"plan": "month", "keys": [{"name": "bm", "plaintext": "sk-b-month"}]},
            "b-fb": {"plan": "fallback", "keys": [{"name": "bf", "plaintext": "sk-b-fb"}]},
            "b-cc": {"plan": "conccut", "keys": [{"name": "bcc", "plaintext": "sk-b-cc"}]},
        },
        **top,
    )
    rules["models"]["sim-small"]["pricing"] = PRICING
    rules["models"]["sim-tiny"] = {**rules["models"]["sim-small"], "aliases": []}
    rules["plans"].update(
        {
            "usd1": {"limits": [{"per": HOUR, "rpm": 1000, "budget": 1.0}]},
            "usd1strict": {
                "limits": [{"per": HOUR, "rpm": 1000, "budget": 1.0}],
                "charging": {"streaming": "strict"},
            },
            "conc2": {"limits": [{"per": HOUR, "rpm": 1000, "concurrency": 2}]},
            "shadow": {
                "limits": [
                    {"per": HOUR, "rpm": 1000, "tpm": 1_000_000},
                    {"per": HOUR, "tpm": 50, "shadow": True},
                ]
            },
            "month": {"limits": [{"per": "month", "budget": 0.2}]},
            "conccut": {
                "limits": [
                    {"per": HOUR, "rpm": 1000, "concurrency": 1},
                    {"model": "sim-small", "per": HOUR, "tpm": 300},
                ]
            },
            "fallback": {
                "limits": [
                    {"per": HOUR, "rpm": 1000, "tpm": 1_000_000},
                    {"model": "sim-small", "per": HOUR, "tpm": 100},
                ],
                "fallback": {"sim-small": "sim-tiny"},
            },
        }
    )
    return rules


@pytest.fixture(scope="module")
def bstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = make_stack(
        Path(tmp_path_factory.mktemp("budgets")),
        rules=budget_rules(),
        sim_args=["--model", "sim-small", "--model", "sim-tiny"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rds(bstack: Stack) -> Iterator[redis.Redis]:
    client = redis.Redis(port=bstack.ports.redis)
    yield client
    client.close()


def oai(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=30)


def spent(rds: redis.Redis, tenant: str) -> int:
    """The tenant's money counter (micro-dollars)."""
    keys = list(rds.scan_iter(f"aiq:{{{tenant}}}:cost.USD:*"))
    return sum(int(rds.get(k) or 0) for k in keys)


def stream(c: openai.OpenAI, **kw: Any) -> tuple[int, Exception | None]:
    """Content chunks received (one token each from the simulator) and the error raised."""
    got = 0
    try:
        for ch in c.chat.completions.create(model="sim-small", messages=MSG, stream=True, **kw):
            if ch.choices and ch.choices[0].delta.content:
                got += 1
    except openai.APIError as exc:
        return got, exc
    return got, None


def test_strict_money_budget_cuts_the_stream_at_the_last_affordable_token(
    bstack: Stack, rds: redis.Redis
) -> None:
    """Strict: the stream stops with budget_exceeded when the dollar runs out; never over."""
    c = oai(bstack, "sk-b-strict")
    got, err = stream(c, max_tokens=1000)
    assert isinstance(err, openai.APIError), "the stream must end with the budget's error"
    assert "budget_exceeded" in str(err.body) or "Budget exhausted" in str(err)
    assert 100 < got < 500
    used = settled(rds, "b-strict")
    assert used == 0  # no TPM limit on this plan: only the money counter moves
    money = spent(rds, "b-strict")
    assert money <= 1_000_000  # strict: never over the budget
    assert money >= 1_000_000 - 2_000 * 16  # and within one charge batch of it
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=10)
    assert info.value.code == "budget_exceeded"
    assert "budget of 1.00 USD per day" in str(info.value)
    h = info.value.response.headers
    assert h["x-ratelimit-limit-budget"] == "1.00" and h["x-ratelimit-budget-unit"] == "USD"


def test_lazy_money_budget_cuts_within_its_bound(bstack: Stack, rds: redis.Redis) -> None:
    """Lazy: cut after the charge that crossed the budget, at most one batch over."""
    got, err = stream(oai(bstack, "sk-b-lazy"), max_tokens=1000)
    assert isinstance(err, openai.APIError)
    settled(rds, "b-lazy")
    money = spent(rds, "b-lazy")
    assert 1_000_000 - 16 * 2_000 < money <= 1_000_000 + 2 * 16 * 2_000
    assert got < 500


def test_settlement_prices_the_real_usage(bstack: Stack, rds: redis.Redis) -> None:
    """A non-stream reserves max_tokens at the output price and settles to what was made."""
    c = oai(bstack, "sk-b-month")
    comp = c.chat.completions.create(
        model="sim-small",
        messages=MSG,
        max_tokens=50,
        extra_headers={"x-sim-tokens": "20", "x-request-id": "priced-1"},
    )
    assert comp.usage is not None
    settled(rds, "b-month")
    # the upstream's own figures (within bounds of the gateway's count) are what is billed
    assert spent(rds, "b-month") == ENGINE_PROMPT * 1_000 + 20 * 2_000
    # the usage record carries the same cost, in dollars
    deadline = time.monotonic() + 10  # the recorder writes in the background, in batches
    mine: list[UsageRecord] = []
    while not mine and time.monotonic() < deadline:
        recs = [UsageRecord.from_fields(f or {}) for _, f in rds.xrange("aiq:usage") or []]
        mine = [r for r in recs if r.request_id == "priced-1"]
        time.sleep(0.05)
    [rec] = mine
    assert rec.currency == "USD"
    assert rec.cost == Decimal(ENGINE_PROMPT * 1_000 + 20 * 2_000).scaleb(-6)


def test_concurrency_limit_refuses_a_third_stream_and_frees_slots(
    bstack: Stack, rds: redis.Redis
) -> None:
    """Two streams run; a third is refused with concurrency_limit_exceeded; once they end, a
    new one is admitted."""
    c = oai(bstack, "sk-b-conc")
    started = [threading.Event(), threading.Event()]
    results: list[tuple[int, Exception | None]] = []

    def run(ev: threading.Event) -> None:
        got = 0
        try:
            for ch in c.chat.completions.create(
                model="sim-small",
                messages=MSG,
                stream=True,
                max_tokens=40,
                extra_headers={"x-sim-itl-ms": "50"},
            ):
                if ch.choices and ch.choices[0].delta.content:
                    got += 1
                    ev.set()
            results.append((got, None))
        except openai.APIError as exc:
            results.append((got, exc))

    threads = [threading.Thread(target=run, args=(ev,)) for ev in started]
    for t in threads:
        t.start()
    assert all(ev.wait(20) for ev in started)
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=5)
    assert info.value.code == "concurrency_limit_exceeded"
    assert info.value.response.headers["x-ratelimit-remaining-concurrency"] == "0"
    for t in threads:
        t.join(30)
    assert results == [(40, None), (40, None)]
    deadline = time.monotonic() + 10
    while rds.zcard("aiq:{b-conc}:conc:t:*") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rds.zcard("aiq:{b-conc}:conc:t:*") == 0
    ok = c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=5)
    assert ok.usage is not None


def test_shadow_limit_never_refuses_and_says_what_it_would_do(bstack: Stack) -> None:
    """A 50-token shadow TPM limit: requests and streams far past it go through, and the
    response names the limit that would have refused."""
    c = oai(bstack, "sk-b-shadow")
    raw = c.chat.completions.with_raw_response.create(
        model="sim-small", messages=MSG, max_tokens=100
    )
    assert raw.http_response.status_code == 200
    assert "tokens per day" in raw.headers.get("x-ratelimit-shadow-exceeded", "")
    got, err = stream(c, max_tokens=300)
    assert err is None and got == 300
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"


def month_boundary_offset(lead_s: float) -> int:
    """Milliseconds to add to the clock so the processor's month ends ``lead_s`` from now."""
    now = datetime.now(tz=UTC)
    nxt = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=UTC)
    return int((nxt.timestamp() - lead_s - time.time()) * 1000)


def test_monthly_budget_resets_at_the_month_boundary(tmp_path: Path) -> None:
    """A month budget spent just before midnight of the month's last day is refused with the
    month named, and admits again once the processor's calendar turns the month."""
    # The processor's month ends 12 s from now: time to start the stack and spend the budget.
    offset = month_boundary_offset(12.0)
    s = make_stack(
        tmp_path / "month", rules=budget_rules(), extproc_env={"AIQ_CLOCK_OFFSET_MS": str(offset)}
    )
    try:
        c = oai(s, "sk-b-month")
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=80)
        with pytest.raises(openai.RateLimitError) as info:
            for _ in range(5):
                c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=80)
        assert info.value.code == "budget_exceeded"
        assert "per month" in str(info.value)
        retry = int(info.value.response.headers["retry-after"])
        assert 1 <= retry <= 12
        deadline = time.monotonic() + 20
        while True:
            try:
                c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=80)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the new month never admitted"
                time.sleep(0.25)
    finally:
        s.stop()


def test_fallback_model_instead_of_429(bstack: Stack, rds: redis.Redis) -> None:
    """sim-small's own 100-token limit refuses a 200-token request; the plan falls back to
    sim-tiny, which answers, charged to the tenant-wide bucket only, and the client is told."""
    c = oai(bstack, "sk-b-fb")
    raw = c.chat.completions.with_raw_response.create(
        model="sim-small", messages=MSG, max_tokens=200
    )
    comp = raw.parse()
    assert raw.headers["x-aiquota-fallback-model"] == "sim-tiny"
    assert raw.headers["x-aiquota-requested-model"] == "sim-small"
    assert comp.model == "sim-tiny"  # the upstream was asked for the fallback
    settled(rds, "b-fb")
    small = list(rds.scan_iter("aiq:{b-fb}:tpm:t:sim-small:*"))
    assert all(int(rds.get(k) or 0) == 0 for k in small)
    [everything] = list(rds.scan_iter("aiq:{b-fb}:tpm:t:*:*"))
    assert int(rds.get(everything) or 0) == ENGINE_PROMPT + 200
    # a request that fits sim-small's own limit is served by sim-small
    ok = c.chat.completions.with_raw_response.create(model="sim-small", messages=MSG, max_tokens=5)
    assert "x-aiquota-fallback-model" not in ok.headers and ok.parse().model == "sim-small"


def test_usage_shows_budgets_periods_and_slots(bstack: Stack, rds: redis.Redis) -> None:
    """``ai-quota usage`` lists the month budget in dollars and the concurrency limit."""

    def usage(key: str) -> dict[str, Any]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "extproc",
                "usage",
                "--key",
                key,
                "--json",
                *usage_flags(bstack),  # the stack's address and CA (docs/security.md)
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return dict(orjson.loads(out.stdout))

    settled(rds, "b-month")
    [money] = usage("sk-b-month")["buckets"]
    assert (money["metric"], money["period"], money["unit"]) == ("cost", "month", "USD")
    assert money["limit_display"] == "0.20" and money["used"] == spent(rds, "b-month")
    conc = next(b for b in usage("sk-b-conc")["buckets"] if b["metric"] == "concurrency")
    assert conc["limit"] == 2 and conc["period"] == "" and conc["used"] == 0


def test_a_cut_stream_frees_its_concurrency_slot(bstack: Stack, rds: redis.Redis) -> None:
    """A stream cut by its TPM limit settles, and settlement frees the tenant's only slot."""
    c = oai(bstack, "sk-b-cc")
    got, err = stream(c, max_tokens=1000)
    assert isinstance(err, openai.APIError) and got < 1000
    settled(rds, "b-cc")
    assert rds.zcard("aiq:{b-cc}:conc:t:*") == 0
    ok = c.chat.completions.create(model="sim-tiny", messages=MSG, max_tokens=5)
    assert ok.usage is not None
