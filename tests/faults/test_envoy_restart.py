"""Envoy killed under streams, on the real stack: its open requests fail (connections reset),
each processor sees its ext_proc streams cancelled and settles what it had forwarded, nothing
stays reserved, and the restarted Envoy serves again."""

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
from tests.helpers import e2e_rules, settled

pytestmark = pytest.mark.faults

STREAMS = 4


@pytest.fixture(scope="module")
def estack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rules = e2e_rules({"t-env": {"plan": "big", "keys": [{"name": "env", "plaintext": "sk-env"}]}})
    s = make_stack(Path(tmp_path_factory.mktemp("envoy")), rules=rules)
    yield s
    s.stop()


def test_envoy_killed_mid_stream_settles_what_was_forwarded(estack: Stack) -> None:
    rds = redis.Redis(port=estack.ports.redis)
    received: list[int] = []
    lock = threading.Lock()
    delivering = threading.Semaphore(0)  # released once per stream, at its 20th token

    def run(i: int) -> None:
        got = 0
        try:
            stream = client(estack, "sk-env").chat.completions.create(
                model="sim-small",
                messages=MSG,
                stream=True,
                max_tokens=500,
                extra_headers={"x-sim-itl-ms": "10", "x-client-request-id": f"env-{i}"},
            )
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    got += 1
                    if got == 20:  # well into its stream
                        delivering.release()
        except (openai.APIError, httpx.HTTPError):
            pass
        with lock:
            received.append(got)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS):  # every stream is delivering
        assert delivering.acquire(timeout=30)
    estack.signal("envoy0", signal.SIGKILL)
    estack.proc("envoy0").popen.wait(10)
    for t in threads:
        t.join(30)
    assert len(received) == STREAMS and all(0 < n < 500 for n in received)
    # Every ledger settles on its own (the processor saw its streams cancelled).
    used = settled(rds, "t-env", expect=STREAMS)
    output = used - STREAMS * PROMPT
    recs = httpx.get(f"{estack.sim_url}/sim/requests").json()["requests"]
    sent = sum(r["tokens_sent"] for r in recs if (r.get("tenant") or "") == "t-env")
    # charged for what the processor forwarded: at least what clients read, at most what the
    # upstream sent before Envoy died
    assert sum(received) <= output <= sent
    assert rds.zcard("aiq:{t-env}:open") == 0  # no reservation left to reclaim
    estack.restart("envoy0")
    deadline = time.monotonic() + 20
    while True:
        try:
            ok = client(estack, "sk-env").chat.completions.create(
                model="sim-small", messages=MSG, max_tokens=5
            )
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "the restarted Envoy never served"
            time.sleep(0.2)
    assert ok.usage is not None
