"""The whole gateway (Envoy, the processor, the simulator, the openai SDK) on a Redis Sentinel
group (a master, two replicas, three sentinels, down-after 1 s): the master SIGKILLed while
streams run.  With AIQ_REDIS_STREAM_TOLERANCE_S longer than the failover, no stream is cut,
and the tenant's counters on the promoted replica hold exactly what the same streams cost
without a failover: nothing lost, nothing doubled."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.bench.redis_ha import SentinelGroup
from extproc.stack import Stack
from tests.e2e.conftest import client, make_stack
from tests.helpers import settled

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]
TOKENS = 800
STREAMS = 3


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SentinelGroup, Stack]]:
    base = Path(tmp_path_factory.mktemp("ha"))
    group = SentinelGroup(base / "sentinel", replicas=2, down_after_ms=1000)
    try:
        stack = make_stack(
            base / "stack",
            redis_url=group.url(),
            extproc_env={"AIQ_REDIS_STREAM_TOLERANCE_S": "10"},
        )
    except BaseException:
        group.stop()
        raise
    yield group, stack
    stack.stop()
    group.stop()


def _stream(stack: Stack, key: str, out: dict[str, object], started: threading.Event) -> None:
    got = 0
    try:
        for ch in client(stack, key).chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=TOKENS,
            stream=True,
            extra_headers={"x-sim-itl-ms": "6"},
        ):
            if ch.choices and ch.choices[0].delta.content:
                got += 1
                if got == 100:
                    started.set()
    except openai.APIError as exc:
        out["error"] = exc
    out["got"] = got


def test_streams_ride_out_a_sentinel_failover(ha: tuple[SentinelGroup, Stack]) -> None:
    group, stack = ha
    # what one such stream costs with no failover (tenant t-drain, same plan)
    ref: dict[str, object] = {}
    done = threading.Event()
    _stream(stack, "sk-drain", ref, done)
    assert ref.get("error") is None and ref["got"] == TOKENS
    # read once its settlement has landed: the client has [DONE] before the processor settles,
    # and the settlement corrects the counter (e.g. to the upstream's input figure, within its
    # bounds, where the gateway had charged its own count)
    with redis.Redis(port=group.master_port(), decode_responses=True) as m:
        one = settled(m, "t-drain")
    assert one > TOKENS
    # STREAMS streams of tenant t-std; the master dies once each has delivered 100 tokens
    outs = [dict[str, object]() for _ in range(STREAMS)]
    starts = [threading.Event() for _ in range(STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(stack, "sk-std", o, s))
        for o, s in zip(outs, starts, strict=True)
    ]
    for t in threads:
        t.start()
    assert all(s.wait(30) for s in starts)
    old = group.master_port()
    group.kill(old)
    new, _ = group.wait_new_master(old, 30.0)
    for t in threads:
        t.join(60)
    assert [o.get("error") for o in outs] == [None] * STREAMS
    assert [o["got"] for o in outs] == [TOKENS] * STREAMS
    # settlements land on the new master (each processor call is bounded; settled() waits up
    # to 15 s for every ledger of the tenant to say so)
    with redis.Redis(port=new, decode_responses=True) as m:
        used = settled(m, "t-std", expect=STREAMS)
        ledgers = {k: m.hgetall(k) for k in m.scan_iter("aiq:{t-std}:*") if m.type(k) == "hash"}
    assert used == STREAMS * one, ledgers
