"""The processor SIGKILLed while non-streaming requests it admitted are waiting for the upstream:
their reservations leak only for the reservation lease, then the tenant's next admission
refunds them (input stays charged).  Ground truth: the counters in Redis."""

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

from extproc.stack import Stack
from tests.e2e.conftest import make_stack
from tests.helpers import e2e_rules, settled, tpm_used

pytestmark = pytest.mark.faults

LEASE_S = 3
MSG = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def kstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rules = e2e_rules(
        {"t-conc1": {"plan": "conc1", "keys": [{"name": "c1", "plaintext": "sk-conc1"}]}}
    )
    rules["plans"]["conc1"] = {"limits": [{"per": "hour", "rpm": 1000, "concurrency": 1}]}
    rules["failure"] = {"reservation_lease_seconds": LEASE_S}
    s = make_stack(Path(tmp_path_factory.mktemp("kill")), rules=rules)
    yield s
    s.stop()


async def _slow_request(url: str) -> int:
    async with httpx.AsyncClient(timeout=30) as c:
        try:
            r = await c.post(
                f"{url}/chat/completions",
                headers={"authorization": "Bearer sk-std", "x-sim-ttft-ms": "8000"},
                content=orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 1000}),
            )
            return r.status_code
        except httpx.HTTPError:
            return 0


async def test_sigkill_leaks_reservations_only_for_the_lease(kstack: Stack) -> None:
    rds = redis.Redis(port=kstack.ports.redis)
    before = tpm_used(rds, "t-std")
    tasks = [asyncio.ensure_future(_slow_request(kstack.base_url)) for _ in range(4)]
    deadline = time.monotonic() + 10
    while tpm_used(rds, "t-std") < before + 4 * 1000 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    reserved = tpm_used(rds, "t-std") - before
    assert reserved >= 4 * 1000  # four admissions, each reserving 1000 output tokens
    input_each = (reserved - 4 * 1000) // 4
    kstack.signal("extproc0", signal.SIGKILL)
    kstack.proc("extproc0").popen.wait(10)
    statuses = await asyncio.gather(*tasks)
    assert all(s != 200 for s in statuses)  # they died with their processor
    kstack.restart("extproc0")
    kstack.wait_extprocs_healthy()
    await asyncio.sleep(LEASE_S + 0.5)
    # The next admission of the tenant reclaims the dead reservations.
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{kstack.base_url}/chat/completions",
            headers={"authorization": "Bearer sk-std"},
            content=orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 5}),
        )
    assert r.status_code == 200
    used = settled(rds, "t-std", expect=1) - before
    # four inputs stay charged, their reserved output is back; plus the new request
    new_request = used - 4 * input_each
    assert 0 < new_request <= input_each + 5


async def test_sigkill_frees_a_concurrency_slot_after_the_lease(kstack: Stack) -> None:
    """A stream holding the tenant's only slot dies with its processor: the slot is refused to
    others while the lease runs, and comes back on its own after it, with no settlement."""
    rds = redis.Redis(port=kstack.ports.redis)
    slots = "aiq:{t-conc1}:conc:t:*"

    async def post(max_tokens: int, ttft_ms: int = 0) -> int:
        async with httpx.AsyncClient(timeout=30) as c:
            try:
                r = await c.post(
                    f"{kstack.base_url}/chat/completions",
                    headers={"authorization": "Bearer sk-conc1", "x-sim-ttft-ms": str(ttft_ms)},
                    content=orjson.dumps(
                        {"model": "sim-small", "messages": MSG, "max_tokens": max_tokens}
                    ),
                )
                return r.status_code
            except httpx.HTTPError:
                return 0

    holder = asyncio.ensure_future(post(100, ttft_ms=8000))
    deadline = time.monotonic() + 10
    while rds.zcard(slots) < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert rds.zcard(slots) == 1
    assert await post(5) == 429  # the only slot is taken
    kstack.signal("extproc0", signal.SIGKILL)
    kstack.proc("extproc0").popen.wait(10)
    assert await holder != 200
    assert rds.zcard(slots) == 1  # nobody settled it: the dead request still holds the slot
    kstack.restart("extproc0")
    kstack.wait_extprocs_healthy()
    killed_at = time.monotonic()
    statuses: list[int] = []
    while True:
        status = await post(5)
        statuses.append(status)
        if status == 200:
            break
        assert status in (429, 503)  # refused while the lease runs (503: Envoy reconnecting)
        assert time.monotonic() - killed_at < LEASE_S + 5, "the dead slot never came back"
        await asyncio.sleep(0.25)
    # the new request's settlement (in the background, after its answer) frees its slot too
    deadline = time.monotonic() + 10
    while rds.zcard(slots) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert rds.zcard(slots) == 0
