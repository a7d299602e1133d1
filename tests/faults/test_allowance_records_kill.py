"""A ``serve`` processor with allowances on, SIGKILLed while requests it admitted from its
allowances are open.  Those requests have no ledger of their own in Redis: their usage-record
drafts ride, batched, to the processor's draft ledger for the tenant (drafts.lua, every
``AIQ_ALLOWANCE_DRAFT_FLUSH_MS``), and requests settled since leave it.  Once its lease runs
out the tenant's next admission reclaims the draft ledger and the gateway writes each open
request's record, once; the requests settled before the kill keep exactly their own record.
Ground truth: the usage stream in a real redis-server and the requests the test made."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.records.model import UsageRecord, record_id_for
from extproc.stack import Stack
from tests.e2e.conftest import make_stack
from tests.helpers import e2e_rules

pytestmark = pytest.mark.faults

LEASE_S = 3
TENANT = "t-alwkill"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
WARM = 60  # quick requests: the processor takes an allowance for the tenant's buckets
DONE = 6  # requests open past a flush (their drafts sent), settled before the kill
OPEN = 12  # requests open at the kill


@pytest.fixture(scope="module")
def rstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rules = e2e_rules(
        {TENANT: {"plan": "big", "keys": [{"name": "alwkill", "plaintext": "sk-alwkill"}]}}
    )
    rules["failure"] = {"reservation_lease_seconds": LEASE_S}
    s = make_stack(
        Path(tmp_path_factory.mktemp("alwkill")),
        rules=rules,
        # the e2e windows are days: allowances apply to windows up to this long
        extproc_env={
            "AIQ_ALLOWANCES": "1",
            "AIQ_ALLOWANCE_MAX_WINDOW_S": "86400",
            "AIQ_ALLOWANCE_TTL_MS": "30000",
            "AIQ_ALLOWANCE_DRAFT_FLUSH_MS": "200",
        },
    )
    yield s
    s.stop()


async def _post(url: str, rid: str, ttft_ms: int = 0) -> int:
    headers = {"authorization": "Bearer sk-alwkill", "x-client-request-id": rid}
    if ttft_ms:
        headers["x-sim-ttft-ms"] = str(ttft_ms)
    body = {"model": "sim-small", "messages": MSG, "max_tokens": 8}
    async with httpx.AsyncClient(timeout=30) as c:
        try:
            r = await c.post(f"{url}/chat/completions", headers=headers, content=orjson.dumps(body))
            return r.status_code
        except httpx.HTTPError:
            return 0


def _records(rds: redis.Redis) -> list[UsageRecord]:
    recs = [UsageRecord.from_fields(f or {}) for _, f in rds.xrange("aiq:usage") or []]
    return [r for r in recs if r.tenant == TENANT]


def _draft_ledgers(rds: redis.Redis) -> dict[str, list[str]]:
    """The tenant's draft ledgers held (state admitted): the request ledgers of their drafts."""
    out: dict[str, list[str]] = {}
    for led in rds.scan_iter(f"aiq:{{{TENANT}}}:req:drafts.*"):
        fields: dict[str, str] = rds.hgetall(led)  # type: ignore[assignment]
        if fields.get("state") == "admitted":
            out[led] = [k[2:] for k in fields if k.startswith("d:")]
    return out


def _open_ledgers(rds: redis.Redis) -> list[str]:
    """Request ledgers (not draft or allowance ledgers) open in Redis with a record draft."""
    leds: list[str] = rds.zrange(f"aiq:{{{TENANT}}}:open", 0, -1)  # type: ignore[assignment]
    return [x for x in leds if ":req:drafts." not in x and rds.hexists(x, "rec")]


async def _until(what: str, cond: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


async def test_sigkilled_processor_leaves_one_record_per_allowance_admitted_request(
    rstack: Stack,
) -> None:
    rds = redis.Redis(port=rstack.ports.redis, decode_responses=True)
    url = rstack.base_url
    sem = asyncio.Semaphore(4)

    async def warm(i: int) -> int:
        async with sem:
            return await _post(url, f"warm-{i}")

    assert await asyncio.gather(*(warm(i) for i in range(WARM))) == [200] * WARM
    # requests whose drafts are sent (open over a flush), settled before the kill: their
    # drafts leave the draft ledger again
    done = [asyncio.ensure_future(_post(url, f"done-{i}", 1_000)) for i in range(DONE)]
    await _until(
        "the drafts of requests still open sent",
        lambda: sum(len(ds) for ds in _draft_ledgers(rds).values()) > 0,
    )
    assert await asyncio.gather(*done) == [200] * DONE
    opened = [asyncio.ensure_future(_post(url, f"open-{i}", 20_000)) for i in range(OPEN)]

    # every open request's draft is in Redis (draft ledger, or its own ledger when Redis
    # admitted it), and nothing else is: the settled ones' drafts left
    def held() -> bool:
        drafts = [d for ds in _draft_ledgers(rds).values() for d in ds]
        return len(drafts) + len(_open_ledgers(rds)) == OPEN

    await _until("the open requests' drafts in Redis", held)
    local = [d for ds in _draft_ledgers(rds).values() for d in ds]
    remote = _open_ledgers(rds)
    assert len(local) >= OPEN // 2, "most open requests were admitted from the allowance"
    # the settled requests' records are written by the recorder's batches: wait for them
    await _until("the settled requests' records written", lambda: len(_records(rds)) >= WARM + DONE)
    settled_before = _records(rds)
    assert len(settled_before) == WARM + DONE
    assert {r.ending for r in settled_before} == {"completed"}

    rstack.signal("extproc0", signal.SIGKILL)
    killed = time.monotonic()
    rstack.proc("extproc0").popen.wait(10)
    assert all(code != 200 for code in await asyncio.gather(*opened))
    rstack.restart("extproc0")
    rstack.wait_extprocs_healthy()
    assert len(_records(rds)) == WARM + DONE  # nobody wrote theirs yet

    # after the lease, the tenant's next admissions reclaim the dead processor's ledgers
    # (up to 8 a call) and write their records; the first answers after the restart may be
    # Envoy's 503 while it reconnects
    await asyncio.sleep(max(0.0, LEASE_S - (time.monotonic() - killed)))
    n = tries = 0
    while len(_records(rds)) < WARM + DONE + OPEN + n:
        assert time.monotonic() - killed < LEASE_S + 30, "the open requests never got records"
        tries += 1
        if await _post(url, f"after-{tries}") == 200:
            n += 1
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)  # a late duplicate, if any, would show now
    recs = _records(rds)
    reclaimed = [r for r in recs if r.ending == "reclaimed"]
    print(
        f"\n{len(local)} allowance-admitted + {len(remote)} Redis-admitted requests open at "
        f"the kill; {len(reclaimed)} reclaimed records, {n} admissions after the restart"
    )
    assert len(recs) == WARM + DONE + OPEN + n
    assert len({r.record_id for r in recs}) == len(recs)  # one record per request
    assert sorted(r.record_id for r in reclaimed) == sorted(
        record_id_for(led) for led in local + remote
    )
    assert all(r.input_tokens > 0 for r in reclaimed)
    # the drafts left Redis with the reclaim: a second reclaim finds none
    assert all(not ds for ds in _draft_ledgers(rds).values())
    rds.close()
