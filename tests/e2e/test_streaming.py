"""Streaming through the real stack: charging every N, the clean cut-off, settlement on every ending."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.core.apis.openai.counting import count_chat_request
from extproc.core.apis.openai.request import MAX_STREAM_INTERVAL
from extproc.core.tokens import TokenizerSpec
from extproc.sim.prompt_tokens import chat_prompt_tokens
from extproc.stack import Stack
from extproc.tokenizers import load_counter
from tests.e2e.conftest import client
from tests.helpers import settled

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]
N = 16  # charge_every_tokens in the e2e rules


def records(stack: Stack, tenant: str) -> list[dict[str, Any]]:
    recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
    return [r for r in recs if r["tenant"] == tenant]


def stream_and_count(c: openai.OpenAI, **kw: object) -> tuple[int, Exception | None]:
    """Content tokens received (the simulator sends one token per chunk) and the error raised."""
    got = 0
    try:
        for ch in c.chat.completions.create(model="sim-small", messages=MSG, stream=True, **kw):  # type: ignore[call-overload]
            if ch.choices and ch.choices[0].delta.content:
                got += 1
    except openai.APIError as exc:
        return got, exc
    return got, None


def prompt_tokens() -> int:
    """What the gateway counts for MSG, with the model's real tokenizer and chat overhead."""
    spec = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")
    return count_chat_request({"messages": MSG}, load_counter(spec), spec)


PROMPT = prompt_tokens()
#: What the simulator (the upstream) reports as ``prompt_tokens`` for MSG: settlement charges
#: the upstream's input figure when it is within bounds of the gateway's count.
ENGINE_PROMPT = chat_prompt_tokens(MSG)
assert ENGINE_PROMPT != PROMPT  # the tests below tell the two figures apart


def test_lazy_stream_is_cut_cleanly_and_the_upstream_stops(stack: Stack, rds: redis.Redis) -> None:
    """Over budget, the client gets an OpenAI error event (the SDK's APIError, not a connection
    error); the upstream is disconnected."""
    c = client(stack, "sk-cut")
    got, err = stream_and_count(c, max_tokens=1000)
    assert isinstance(err, openai.APIError)
    assert not isinstance(err, openai.APIConnectionError)
    assert "Rate limit reached for tokens" in err.message and "t-cut" in err.message
    assert 0 < got < 1000
    rec = records(stack, "t-cut")[-1]
    assert rec["ending"] == "client_disconnected"
    assert rec["tokens_sent"] < 1000
    assert rec["disconnected_at"] is not None
    used = settled(rds, "t-cut")
    # lazy: the counter equals what was delivered (+ input), over the limit by at most one batch
    assert 300 <= used <= 300 + N + 2
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=5)
    assert info.value.code == "tpm_limit_exceeded"


def test_cut_stream_bytes_end_with_error_event_then_an_abort(
    stack: Stack, rds: redis.Redis
) -> None:
    """On the wire the cut stream ends with one ``event: error`` (a comment line with the
    message, the OpenAI error object as data), no [DONE], then the response is aborted: the
    HTTP/1.1 body never gets its last chunk, so clients that only watch the transport see a
    failed request."""
    body = orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 1000, "stream": True})
    raw = b""
    with (
        pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"),
        httpx.stream(
            "POST",
            f"{stack.base_url}/chat/completions",
            content=body,
            headers={"authorization": "Bearer sk-meta", "content-type": "application/json"},
        ) as r,
    ):
        assert r.status_code == 200
        for piece in r.iter_bytes():
            raw += piece
    events = [e for e in raw.split(b"\n\n") if e]
    assert b"[DONE]" not in raw
    head, comment, data = events[-1].split(b"\n")
    assert head == b"event: error"
    err = orjson.loads(data.removeprefix(b"data: "))["error"]
    assert err["code"] == "tpm_limit_exceeded" and err["type"] == "tokens"
    assert "resets in" in err["message"]
    assert comment == b": " + err["message"].encode()
    for e in events[:-1]:
        assert e.startswith(b"data: {")
        assert "error" not in orjson.loads(e.removeprefix(b"data: "))


def test_access_log_shows_charged_tokens_and_ending(stack: Stack, rds: redis.Redis) -> None:
    """Envoy's access log line carries tenant, model, input/output tokens and how it ended."""
    # The t-meta stream was cut by the test above.
    deadline = time.monotonic() + 5
    lines: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not lines:
        log = (stack.workdir / "envoy0.log").read_text(errors="replace")
        lines = [orjson.loads(x) for x in log.splitlines() if x.startswith("{") and '"t-meta"' in x]
        time.sleep(0.1)
    assert lines, "no access log line for t-meta"
    cut = [x for x in lines if x["ending"] == "cut"]
    assert cut, lines
    assert cut[0]["model"] == "sim-small"
    assert int(cut[0]["output_tokens"]) > 0 and int(cut[0]["input_tokens"]) > 0


def test_strict_stream_never_exceeds_the_limit_and_uses_it(stack: Stack, rds: redis.Redis) -> None:
    """Strict mode: delivered + input never passes the limit, and at least 95% of it is used."""
    c = client(stack, "sk-strict")
    got, err = stream_and_count(c, max_tokens=1000)
    assert isinstance(err, openai.APIError) and "Rate limit reached" in err.message
    used = settled(rds, "t-strict")
    assert used <= 300
    assert used >= 0.95 * 300
    # the counter is exactly what was delivered plus the prompt
    assert used == got + PROMPT


def test_client_disconnect_mid_stream_charges_what_was_delivered(
    stack: Stack, rds: redis.Redis
) -> None:
    """A client that walks away is charged for the tokens that passed, and the upstream stops."""
    c = client(stack, "sk-disc")
    stream = c.chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=1000, stream=True
    )
    got = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            got += 1
        if got == 100:
            break
    stream.close()
    used = settled(rds, "t-disc")
    rec = records(stack, "t-disc")[-1]
    deadline = time.monotonic() + 5
    while rec["ending"] == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.05)
        rec = records(stack, "t-disc")[-1]
    assert rec["ending"] == "client_disconnected"
    assert rec["tokens_sent"] < 1000
    prompt = PROMPT
    # charged: what passed the gateway (>= what the client read, <= what the upstream sent)
    assert got <= used - prompt + 5
    assert used - prompt <= rec["tokens_sent"] + 5


def test_a_clients_huge_stream_interval_is_lowered_to_the_bound(
    stack: Stack, rds: redis.Redis
) -> None:
    """A client asking the engine for 100,000 tokens per chunk (vLLM's ``stream_interval``:
    every token but the first held back to the end, unseen by the meter, unbilled if the
    client then leaves) gets chunks of at most MAX_STREAM_INTERVAL tokens; walking away
    after two chunks, it is billed what the upstream sent."""
    before = settled(rds, "t-disc", expect=0)
    c = client(stack, "sk-disc")
    stream = c.chat.completions.create(
        model="sim-small",
        messages=MSG,
        max_tokens=600,
        stream=True,
        extra_body={"stream_interval": 100_000},
    )
    chunks = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            chunks += 1
        if chunks == 3:
            break
    stream.close()
    used = settled(rds, "t-disc") - before
    rec = records(stack, "t-disc")[-1]
    deadline = time.monotonic() + 5
    while rec["ending"] == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.05)
        rec = records(stack, "t-disc")[-1]
    assert rec["chunk_tokens"] == MAX_STREAM_INTERVAL, rec
    assert rec["ending"] == "client_disconnected", rec
    assert 1 + MAX_STREAM_INTERVAL <= rec["tokens_sent"] < 600, rec
    assert used - PROMPT <= rec["tokens_sent"] + 5, (used, rec)


def test_upstream_reset_mid_stream_charges_what_was_generated(
    stack: Stack, rds: redis.Redis
) -> None:
    """When the upstream dies mid-stream, the tokens it sent are charged, not max_tokens."""
    c = client(stack, "sk-reset")
    got, err = stream_and_count(c, max_tokens=800, extra_headers={"x-sim-disconnect-after": "120"})
    assert err is not None
    # A TCP reset may discard the last bytes in flight, so the client sees at most 120.
    assert 100 <= got <= 120
    used = settled(rds, "t-reset")
    prompt = PROMPT
    assert got <= used - prompt + 5
    assert used - prompt <= 120 + 5


def test_upstream_malformed_event_is_forwarded_and_counted(stack: Stack, rds: redis.Redis) -> None:
    """A broken SSE event from the upstream reaches the client unchanged; the stream carries on."""
    body = orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 50, "stream": True})
    with httpx.stream(
        "POST",
        f"{stack.base_url}/chat/completions",
        content=body,
        headers={
            "authorization": "Bearer sk-std",
            "content-type": "application/json",
            "x-sim-malformed-after": "10",
        },
    ) as r:
        raw = b"".join(r.iter_bytes())
    assert b"data: {not json" in raw
    assert raw.endswith(b"data: [DONE]\n\n")


async def _astream(c: openai.AsyncOpenAI, max_tokens: int) -> tuple[int, bool]:
    got = 0
    try:
        stream = await c.chat.completions.create(
            model="sim-small", messages=MSG, max_tokens=max_tokens, stream=True
        )
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                got += 1
    except openai.RateLimitError:
        return got, False
    except openai.APIError:
        return got, True
    return got, True


async def _concurrent(pair: Stack, key: str, streams: int) -> list[tuple[int, bool]]:
    clients = [
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key=key, max_retries=0)
        for p in pair.envoy_ports
    ]
    tasks = [_astream(clients[i % len(clients)], 400) for i in range(streams)]
    out = await asyncio.gather(*tasks)
    for cl in clients:
        await cl.close()
    return list(out)


@pytest.mark.parametrize(
    ("key", "tenant", "strict"),
    [("sk-conclazy", "t-conclazy", False), ("sk-concstrict", "t-concstrict", True)],
)
async def test_concurrent_streams_through_two_envoys_stay_within_bound(
    pair: Stack, key: str, tenant: str, strict: bool
) -> None:
    """24 concurrent streams of one tenant via 2 Envoys x 2 processors: the simulator's ground
    truth stays within the mode's bound (strict: the limit; lazy: limit + N per stream)."""
    streams = 24
    results = await _concurrent(pair, key, streams)
    rds = redis.Redis(port=pair.ports.redis, decode_responses=True)
    delivered = sum(g for g, _ in results)
    admitted = sum(1 for _, a in results if a)
    used = settled(rds, tenant, expect=admitted)
    prompt = PROMPT
    if strict:
        assert used <= 2000
        assert delivered + admitted * prompt <= 2000
        assert delivered + admitted * prompt >= 0.95 * 2000
    else:
        # lazy: N per stream normally; 2N when Redis falls behind (the meter then waits)
        assert used <= 2000 + 2 * N * streams
        # and it does limit, not refuse: the demand (24 x 400) is far above the limit, and
        # at least the limit's worth went through
        assert delivered + admitted * prompt >= 0.95 * 2000
    # the counters agree with what passed: ground truth from the simulator bounds the delivery
    truth = sum(r["tokens_sent"] for r in records(pair, tenant))
    assert delivered <= truth


def test_zero_token_stream_ends_cleanly(stack: Stack, rds: redis.Redis) -> None:
    """A stream with no content tokens still ends with its finish chunk and [DONE], no hang."""
    body = orjson.dumps({"model": "sim-small", "messages": MSG, "max_tokens": 50, "stream": True})
    with httpx.stream(
        "POST",
        f"{stack.base_url}/chat/completions",
        content=body,
        timeout=20,
        headers={
            "authorization": "Bearer sk-std",
            "content-type": "application/json",
            "x-sim-tokens": "0",
        },
    ) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    assert b'"finish_reason":"stop"' in raw


def test_upstream_error_status_on_a_stream_is_passed_and_refunded(
    stack: Stack, rds: redis.Redis
) -> None:
    """A streaming request the upstream refuses (503) reaches the client as that error, costs no TPM."""
    c = client(stack, "sk-uperr")
    before = settled(rds, "t-uperr", expect=0)
    with pytest.raises(openai.InternalServerError):
        list(
            c.chat.completions.create(
                model="sim-small",
                messages=MSG,
                max_tokens=20,
                stream=True,
                extra_headers={"x-sim-status": "503"},
            )
        )
    assert settled(rds, "t-uperr") == before
