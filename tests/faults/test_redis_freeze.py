"""Redis frozen for 15 s under load, on the real stack, far past the processor's wait for a
failover (AIQ_REDIS_FAILOVER_WAIT_S, 2 s here): running streams are cut cleanly (fail closed)
once their charges have waited that long, new requests get a 503 after it, settlements Redis could not take are kept and applied
once it is back, and the tenant is charged exactly what reached its clients."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from extproc.stack import Stack
from tests.e2e.conftest import client, make_stack
from tests.e2e.test_streaming import MSG, PROMPT
from tests.helpers import e2e_rules, settled, tpm_used

pytestmark = pytest.mark.faults

FREEZE_S = 15.0
STREAMS = 6


@pytest.fixture(scope="module")
def zstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rules = e2e_rules({"t-frz": {"plan": "big", "keys": [{"name": "frz", "plaintext": "sk-frz"}]}})
    s = make_stack(
        Path(tmp_path_factory.mktemp("freeze")),
        rules=rules,
        extproc_env={"AIQ_REDIS_FAILOVER_WAIT_S": "2"},
    )
    yield s
    s.stop()


def test_a_15s_freeze_cuts_streams_cleanly_and_bills_exactly_what_was_delivered(
    zstack: Stack,
) -> None:
    rds = redis.Redis(port=zstack.ports.redis)
    results: list[tuple[int, Exception | None]] = []
    lock = threading.Lock()
    delivering = threading.Semaphore(0)  # released once per stream, at its 20th token

    def run() -> None:
        c = client(zstack, "sk-frz")
        got, err = 0, None
        try:
            stream = c.chat.completions.create(
                model="sim-small",
                messages=MSG,
                stream=True,
                max_tokens=400,
                extra_headers={"x-sim-itl-ms": "20"},
            )
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    got += 1
                    if got == 20:  # past its first charges (every 16 tokens)
                        delivering.release()
        except openai.APIError as exc:
            err = exc
        with lock:
            results.append((got, err))

    threads = [threading.Thread(target=run) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS):  # every stream is delivering
        assert delivering.acquire(timeout=30)
    zstack.signal("redis", signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        # every stream is cut while Redis is frozen (its next charge cannot be made)
        for t in threads:
            t.join(FREEZE_S - 2)
        with lock:
            assert len(results) == STREAMS, "streams still running with Redis frozen"
        # New requests during the freeze: a JSON 503, not a hang.
        during = []
        for _ in range(3):
            r = httpx.post(
                f"{zstack.base_url}/chat/completions",
                headers={"authorization": "Bearer sk-frz"},
                json={"model": "sim-small", "messages": MSG, "max_tokens": 5},
                timeout=10,
            )
            during.append((r.status_code, r.json()["error"]["code"]))
        assert during == [(503, "quota_backend_unavailable")] * 3
        # the fault itself: Redis stays frozen for FREEZE_S in all
        time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))
    finally:
        zstack.signal("redis", signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert len(results) == STREAMS
    for got, err in results:
        # cut with the backend-unavailable error event, after some tokens and before the end
        assert isinstance(err, openai.APIError) and "quota backend" in str(err)
        assert 0 < got < 400
    # Kept settlements are applied once Redis answers: every ledger settles, exactly.
    used = settled(rds, "t-frz", expect=STREAMS)
    delivered = sum(got for got, _ in results)
    assert used == STREAMS * PROMPT + delivered
    # and the gateway is back to normal
    ok = client(zstack, "sk-frz").chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=5
    )
    assert ok.usage is not None
    assert tpm_used(rds, "t-frz") >= used
