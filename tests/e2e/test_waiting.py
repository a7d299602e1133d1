"""Waiting instead of an immediate 429, end to end with config/examples/waiting.yaml, two
Envoys in front of two processor replicas sharing one Redis (requests alternate between the
Envoys, so every scenario runs on both replicas and one queue order serves them all):

* sk-nowait (no wait): its 3rd concurrent request gets a 429 at once;
* sk-wait-a: 4 concurrent requests are all answered, 2 at once and 2 just after the next 10 s
  boundary, with ``x-ratelimit-waited-ms``;
* 6 concurrent from each of wait-a and wait-b: 2 per tenant per window reach the upstream
  (the simulator's own records), those whose turn would come after 15 s are refused within
  2 s of arriving with a ``retry-after`` beyond 15 s (two queues per replica would have let
  them wait and then refused them in vain);
* a client that hangs up while waiting leaves the queue at once (nothing reaches the upstream
  for it);
* the processors' metrics count what happened, the usage records carry the wait.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.core.keys import tenant_tag
from extproc.core.waiting import queue_keys
from extproc.records.model import UsageRecord
from extproc.stack import Stack, free_port, port_in_use
from tests.e2e.conftest import caller_metadata, grpc_channel, make_stack

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "waiting.yaml"
WINDOW = 10.0
BODY = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Answer:
    key: str
    status: int
    started: float  # unix seconds
    took: float
    headers: dict[str, str]
    body: str = ""


@pytest.fixture(scope="module")
def wstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    metrics = free_port()
    while port_in_use(metrics + 1):  # replica i serves metrics on metrics + i
        metrics = free_port()
    s = make_stack(
        Path(tmp_path_factory.mktemp("waiting")),
        envoys=2,
        extprocs=2,
        rules=yaml.safe_load(EXAMPLE.read_text()),
        metrics_port=metrics,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rds(wstack: Stack) -> Iterator[redis.Redis]:
    client = redis.Redis(port=wstack.ports.redis, decode_responses=True)
    yield client
    client.close()


def ask(stack: Stack, key: str, envoy: int, *, timeout: float = 30.0) -> Answer:
    """One chat completion through Envoy ``envoy`` (an Answer with status 0: the client gave
    up at ``timeout``, closing its connection)."""
    url = f"http://127.0.0.1:{stack.envoy_ports[envoy]}/v1/chat/completions"
    start = time.time()
    try:
        r = httpx.post(url, json=BODY, headers={"authorization": f"Bearer {key}"}, timeout=timeout)
    except httpx.TimeoutException:
        return Answer(key, 0, start, time.time() - start, {})
    return Answer(key, r.status_code, start, time.time() - start, dict(r.headers), r.text)


def burst(stack: Stack, keys: list[str], **kw: Any) -> list[Answer]:
    """All of ``keys`` at once, alternating between the two Envoys."""
    with ThreadPoolExecutor(len(keys)) as pool:
        futs = [pool.submit(ask, stack, k, i % 2, **kw) for i, k in enumerate(keys)]
        return [f.result() for f in futs]


def window_start(offset: float = 0.4) -> float:
    """Sleep until ``offset`` seconds into the next 10 s window; that window's start."""
    now = time.time()
    start = (now // WINDOW + 1) * WINDOW
    time.sleep(start + offset - now)
    return start


def sim_records(stack: Stack, tenant: str) -> list[dict[str, Any]]:
    recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
    return [r for r in recs if r["tenant"] == tenant]


def metric(stack: Stack, name: str, **labels: str) -> float:
    """A counter summed over both replicas."""
    total = 0.0
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for i in range(2):
        text = httpx.get(f"http://127.0.0.1:{stack.metrics_port + i}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}}") or (not want and line.startswith(name + " ")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_waiting_as_the_example_says(wstack: Stack, rds: redis.Redis) -> None:
    # warm both replicas (tokenizers, connections) in a window no scenario uses
    for envoy in (0, 1):
        for key in ("sk-nowait", "sk-wait-b"):
            assert ask(wstack, key, envoy).status == 200
    # -- sk-nowait: the 3rd concurrent request is refused at once; sk-wait-a: 4 all answered
    w0 = window_start()
    got = burst(wstack, ["sk-nowait"] * 3 + ["sk-wait-a"] * 4)
    nowait = sorted(got[:3], key=lambda a: a.status)
    assert [a.status for a in nowait] == [200, 200, 429]
    assert nowait[2].took < 2.0, nowait[2]
    a = sorted(got[3:], key=lambda x: x.took)
    assert [x.status for x in a] == [200] * 4, a
    assert all(x.took < 2.0 for x in a[:2]), a
    for x in a[2:]:  # just after the next boundary
        done = x.started + x.took
        assert w0 + WINDOW <= done < w0 + WINDOW + 2.0, (x, w0)
        # from its first admission call (after its count) to its admission
        waited = int(x.headers["x-ratelimit-waited-ms"])
        assert x.took * 1000 - 2500 <= waited <= x.took * 1000, x
    assert int(a[0].headers["x-ratelimit-waited-ms"]) == 0
    told = [int(x.headers["x-ratelimit-waited-ms"]) for x in a[2:]]

    # -- 6 concurrent from each of wait-a and wait-b, in a window where both start from 0
    w1 = window_start()  # the window after w0's next: wait-a's waiters took that one
    assert w1 >= w0 + 2 * WINDOW
    before = {t: len(sim_records(wstack, t)) for t in ("wait-a", "wait-b")}
    got = burst(wstack, ["sk-wait-a", "sk-wait-b"] * 6)
    for key in ("sk-wait-a", "sk-wait-b"):
        mine = sorted((x for x in got if x.key == key), key=lambda x: x.took)
        assert [x.status for x in mine].count(200) == 4, mine
        refused = [x for x in mine if x.status == 429]
        assert len(refused) == 2, mine
        for x in refused:  # at once, told when its turn would have been (w1 + 20 s)
            assert x.took < 2.0, x
            assert float(x.headers["retry-after-ms"]) / 1000 > 15.0, x
        served = [x for x in mine if x.status == 200]
        assert sum(1 for x in served if x.took < 2.0) == 2, served
        told += [int(x.headers["x-ratelimit-waited-ms"]) for x in served[2:]]
        assert all(w1 + WINDOW <= x.started + x.took < w1 + WINDOW + 2.0 for x in served[2:])
    # the upstream's own records: at most 2 per tenant per window, 4 each in this scenario
    for tenant in ("wait-a", "wait-b"):
        recs = sim_records(wstack, tenant)
        assert len(recs) - before[tenant] == 4, recs
        per = Counter(int(r["started_at"] // WINDOW) for r in recs)
        assert max(per.values()) <= 2, per
        q = queue_keys(tenant_tag("aiq", tenant), tenant)[0]
        assert rds.zcard(q) == 0

    # -- a client that hangs up while waiting leaves the queue at once
    window_start()
    q = queue_keys(tenant_tag("aiq", "wait-b"), "wait-b")[0]
    n_before = len(sim_records(wstack, "wait-b"))
    got = burst(wstack, ["sk-wait-b"] * 3, timeout=2.0)
    assert sorted(x.status for x in got) == [0, 200, 200], got
    deadline = time.monotonic() + 2
    while rds.zcard(q) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rds.zcard(q) == 0
    time.sleep(WINDOW)  # past the turn it would have had: nothing went upstream for it
    assert len(sim_records(wstack, "wait-b")) - n_before == 2

    # -- what the processors counted, and the usage records
    assert metric(wstack, "aiq_wait_outcomes_total", outcome="admitted") == 2 + 2 * 2
    assert metric(wstack, "aiq_wait_outcomes_total", outcome="unservable") == 2 * 2
    assert metric(wstack, "aiq_wait_seconds_count", outcome="admitted") == 6
    assert metric(wstack, "aiq_waiters") == 0
    deadline = time.monotonic() + 10
    while True:
        usage = [UsageRecord.from_fields(f or {}) for _, f in rds.xrange("aiq:usage") or []]
        long = [r for r in usage if r.waited_ms > 0]
        if len(long) >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(r.waited_ms for r in long) == sorted(told), (long, told)


def test_a_wait_longer_than_envoys_message_timeout_is_held(wstack: Stack) -> None:
    """Envoy's ext_proc message_timeout is 12 s; a request waiting 14 s for its turn is held
    (the processor's override_message_timeout, within max_message_timeout 60 s) and served."""
    window_start()  # a window no scenario of this module used for wait-a
    w = window_start(6.0)
    got = sorted(burst(wstack, ["sk-wait-a"] * 6), key=lambda x: x.took)
    assert [x.status for x in got] == [200] * 6, got
    for x in got[4:]:  # their turn: two boundaries on, 14 s after they came
        assert x.took > 12.5, x
        assert w + 2 * WINDOW <= x.started + x.took < w + 2 * WINDOW + 2.0, (x, w)
    stats = httpx.get(f"http://127.0.0.1:{wstack.ports.envoy_admin}/stats").text
    overrides = [ln for ln in stats.splitlines() if "override_message_timeout" in ln]
    assert any(not ln.endswith(": 0") for ln in overrides), overrides


def direct(stack: Stack, replica: int, key: str, rid: str) -> list[Any]:
    """One request straight to processor ``replica``'s ext_proc stream, as Envoy opens one
    (headers, then the whole body): the responses it got, and the error that ended it, if any."""
    hh = pb.HttpHeaders()
    for k, v in {
        ":path": "/v1/chat/completions",
        ":method": "POST",
        "authorization": f"Bearer {key}",
        "content-type": "application/json",
        "x-request-id": rid,
    }.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    body = httpx.Request("POST", "http://x", json=BODY).content
    reqs = iter(
        [
            pb.ProcessingRequest(request_headers=hh),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        ]
    )
    out: list[Any] = []
    with grpc_channel(stack, stack.extproc_ports[replica]) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        try:
            for r in stub.Process(reqs, metadata=caller_metadata(stack), timeout=40):
                out.append(r)
        except grpc.RpcError as exc:
            out.append(exc)
    return out


def test_a_killed_processors_ticket_lapses_and_holds_nobody_back(
    wstack: Stack, rds: redis.Redis
) -> None:
    """A request held by a processor that dies (SIGKILL) leaves its ticket behind: a waiter
    behind it is still served at its own turn (room for both), and the dead ticket lapses at
    its turn plus 3 s (the next admission of the tenant drops it).  Last in this module: it
    kills a replica."""
    q = queue_keys(tenant_tag("aiq", "wait-b"), "wait-b")[0]
    window_start()
    w = window_start()  # two windows on: wait-b's earlier ones are over
    assert [x.status for x in burst(wstack, ["sk-wait-b"] * 2)] == [200, 200]
    with ThreadPoolExecutor(2) as pool:
        doomed = pool.submit(direct, wstack, 1, "sk-wait-b", "doomed-1")
        deadline = time.monotonic() + 5
        while rds.zcard(q) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rds.zcard(q) == 1  # replica 1 holds it, waiting for w + 10 s
        wstack.signal("extproc1", signal.SIGKILL)
        assert any(isinstance(r, Exception) for r in doomed.result())  # its stream broke
        assert rds.zcard(q) == 1  # its ticket stays behind
        behind = pool.submit(direct, wstack, 0, "sk-wait-b", "behind-1")
        got = behind.result()
    done = time.time()
    bodies = [r for r in got if not isinstance(r, Exception) and r.HasField("request_body")]
    assert bodies, got  # admitted: its body goes upstream
    assert w + WINDOW <= done < w + WINDOW + 2.0
    # the dead ticket lapses at w + 10 s + 3 s: the tenant's next admission after it drops it
    time.sleep(max(0.0, w + WINDOW + 3.5 - time.time()))
    assert rds.zcard(q) == 1
    after = direct(wstack, 0, "sk-wait-b", "after-1")
    assert any(not isinstance(r, Exception) and r.HasField("request_body") for r in after)
    assert rds.zcard(q) == 0
