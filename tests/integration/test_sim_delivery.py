"""Integration tests: the simulator's hostile-upstream faults, observed at the HTTP level.

gzip bodies, odd or missing content types, merged and burst chunks, lying usage, a
Content-Length on a stream, generation without a budget, and batched completions prompts; each
checked against the ground-truth record.
"""

from __future__ import annotations

import asyncio
import gzip
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from extproc.sim.app import start_sim
from extproc.sim.config import SimConfig
from extproc.sim.text import count_tokens

pytestmark = pytest.mark.integration

MODEL = "sim-small"
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 20,
}
CONTEXT = 300


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim_port() -> AsyncIterator[int]:
    """A fast simulator with a small context window."""
    runner: web.AppRunner
    runner, port = await start_sim(SimConfig(port=0, ttft_ms=1, itl_ms=0.2, context_tokens=CONTEXT))
    yield port
    await runner.cleanup()


class Raw:
    """What came over the wire: status, headers, the body bytes and each read as received."""

    def __init__(self, status: int, headers: dict[str, str], reads: list[bytes]) -> None:
        self.status = status
        self.headers = headers
        self.reads = reads
        self.body = b"".join(reads)


async def post(
    port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Raw:
    """POST without decompression; keeps raw header names (lower-cased) and bytes."""
    async with (
        aiohttp.ClientSession(auto_decompress=False) as http,
        http.post(
            f"http://127.0.0.1:{port}{path}",
            data=orjson.dumps(body),
            headers={"content-type": "application/json", **(headers or {})},
            skip_auto_headers=["Accept-Encoding"],
        ) as resp,
    ):
        reads = [chunk async for chunk in resp.content.iter_any()]
        hdrs = {k.decode().lower(): v.decode() for k, v in resp.raw_headers}
        return Raw(resp.status, hdrs, reads)


def events(data: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded JSON or the raw string for [DONE]) of each SSE event."""
    out: list[tuple[str | None, Any]] = []
    for block in data.split(b"\n\n"):
        if not block.strip():
            continue
        name = None
        payload = b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                payload = line[6:]
        out.append((name, "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)))
    return out


def content_deltas(api: str, evs: list[tuple[str | None, Any]]) -> list[str]:
    """Text of each content-carrying event of ``api``."""
    out: list[str] = []
    for name, data in evs:
        if api == "chat" and isinstance(data, dict):
            for choice in data.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    out.append(text)
        elif api == "responses" and name == "response.output_text.delta":
            out.append(data["delta"])
        elif (
            api == "messages"
            and name == "content_block_delta"
            and data["delta"]["type"] == "text_delta"
        ):
            out.append(data["delta"]["text"])
    return out


async def record_for(port: int, crid: str) -> dict[str, Any]:
    """The final ground-truth record of ``crid``."""
    async with aiohttp.ClientSession() as http:
        for _ in range(500):
            url = f"http://127.0.0.1:{port}/sim/requests"
            async with http.get(url, params={"client_request_id": crid}) as resp:
                records = (await resp.json())["requests"]
            if records and records[0]["ending"] != "in_progress":
                return dict(records[0])
            await asyncio.sleep(0.01)
    raise AssertionError(f"no final record for {crid}")


def _crid() -> str:
    return f"t-{uuid.uuid4().hex}"


PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def _body(api: str, budget: int = 20) -> dict[str, Any]:
    if api == "chat":
        return {**CHAT, "max_tokens": budget, "stream": True}
    if api == "responses":
        return {"model": MODEL, "input": "hello", "max_output_tokens": budget, "stream": True}
    return {
        "model": MODEL,
        "max_tokens": budget,
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
    }


# -- gzip ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_gzip_stream_decodes_chunk_by_chunk(sim_port: int, api: str) -> None:
    """x-sim-gzip: a gzip stream (without Accept-Encoding) whose every read decodes at once."""
    crid = _crid()
    raw = await post(
        sim_port,
        PATHS[api],
        _body(api),
        {"x-sim-gzip": "1", "x-client-request-id": crid, "x-sim-itl-ms": "2"},
    )
    assert raw.status == 200
    assert raw.headers["content-encoding"] == "gzip"
    assert raw.body[:2] == b"\x1f\x8b"
    decoder = zlib.decompressobj(wbits=31)
    plain = b""
    for chunk in raw.reads:
        plain += decoder.decompress(chunk)
    assert decoder.eof and decoder.unused_data == b""
    assert plain == gzip.decompress(raw.body)
    evs = events(plain)
    text = "".join(content_deltas(api, evs))
    rec = await record_for(sim_port, crid)
    assert count_tokens(text) == rec["tokens_sent"] == 20
    assert rec["content_encoding"] == "gzip"


async def test_gzip_seen_through_the_openai_sdk(sim_port: int) -> None:
    """httpx decodes the forced gzip: the SDK still sees the exact stream and usage."""
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{sim_port}/v1", api_key="x", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=15,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-sim-gzip": "1"},
        )
        text = ""
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
    assert usage is not None and usage.completion_tokens == count_tokens(text) == 15


async def test_gzip_non_streaming_and_accept_encoding(sim_port: int) -> None:
    """Non-streaming gzip; honour-accept-encoding gzips only when the client accepts gzip."""
    raw = await post(sim_port, "/v1/chat/completions", CHAT, {"x-sim-gzip": "1"})
    assert raw.headers["content-encoding"] == "gzip"
    body = orjson.loads(gzip.decompress(raw.body))
    assert body["usage"]["completion_tokens"] == 20
    assert int(raw.headers["content-length"]) == len(raw.body)

    honour = {"x-sim-honour-accept-encoding": "1"}
    raw = await post(
        sim_port, "/v1/chat/completions", CHAT, {**honour, "accept-encoding": "gzip, br"}
    )
    assert raw.headers.get("content-encoding") == "gzip"
    raw = await post(sim_port, "/v1/chat/completions", CHAT, honour)
    assert "content-encoding" not in raw.headers
    assert orjson.loads(raw.body)["object"] == "chat.completion"
    raw = await post(sim_port, "/v1/chat/completions", CHAT, {"accept-encoding": "gzip"})
    assert "content-encoding" not in raw.headers


# -- content type ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["Text/Event-Stream; charset=utf-8", "application/x-ndjson", "none"]
)
async def test_stream_content_type_override(sim_port: int, value: str) -> None:
    """x-sim-content-type: the header is exactly what was asked (or absent); bytes are SSE."""
    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/chat/completions",
        {**CHAT, "stream": True},
        {"x-sim-content-type": value, "x-client-request-id": crid},
    )
    assert raw.status == 200
    if value == "none":
        assert "content-type" not in raw.headers
    else:
        assert raw.headers["content-type"] == value
    evs = events(raw.body)
    assert evs[-1] == (None, "[DONE]")
    assert count_tokens("".join(content_deltas("chat", evs))) == 20
    rec = await record_for(sim_port, crid)
    assert rec["content_type"] == (None if value == "none" else value)


# -- chunking -------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_chunk_tokens_merge_k_tokens_per_event(sim_port: int, api: str) -> None:
    """x-sim-chunk-tokens: K: every content event carries K tokens (the last may carry fewer)."""
    crid = _crid()
    raw = await post(
        sim_port,
        PATHS[api],
        _body(api, 23),
        {"x-sim-chunk-tokens": "5", "x-client-request-id": crid},
    )
    sizes = [count_tokens(t) for t in content_deltas(api, events(raw.body))]
    assert sizes == [5, 5, 5, 5, 3]
    rec = await record_for(sim_port, crid)
    assert (rec["tokens_sent"], rec["chunk_tokens"], rec["burst"]) == (23, 5, False)


async def test_burst_sends_the_answer_in_one_write(sim_port: int) -> None:
    """x-sim-burst-tokens: K-token events, all tokens accounted by a single write."""
    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/messages",
        _body("messages", 22),
        {"x-sim-burst-tokens": "4", "x-sim-itl-ms": "50", "x-client-request-id": crid},
    )
    sizes = [count_tokens(t) for t in content_deltas("messages", events(raw.body))]
    assert sizes == [4, 4, 4, 4, 4, 2]
    rec = await record_for(sim_port, crid)
    assert rec["burst"] is True and rec["chunk_tokens"] == 4
    assert rec["tokens_sent"] == 22
    # one write carried every token: first and last token times are the same write
    assert rec["first_token_at"] == rec["last_token_at"]


# -- lying usage ----------------------------------------------------------------------------------


async def test_usage_lies_while_records_tell_the_truth(sim_port: int) -> None:
    """x-sim-usage: fixed, scaled or absent usage; tokens_sent keeps the real count."""
    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        {"x-sim-usage": "7", "x-client-request-id": crid},
    )
    usage = [d["usage"] for _, d in events(raw.body) if isinstance(d, dict) and d.get("usage")]
    assert [u["completion_tokens"] for u in usage] == [7]
    rec = await record_for(sim_port, crid)
    assert (rec["tokens_sent"], rec["usage_reported"], rec["usage_lie"]) == (20, 7, "7")

    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/responses",
        {"model": MODEL, "input": "hi", "max_output_tokens": 20},
        {"x-sim-usage": "scale:0.5", "x-client-request-id": crid},
    )
    body = orjson.loads(raw.body)
    assert body["usage"]["output_tokens"] == 10
    text = body["output"][-1]["content"][0]["text"]
    rec = await record_for(sim_port, crid)
    assert count_tokens(text) == rec["tokens_sent"] == 20
    assert rec["usage_reported"] == 10

    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/messages",
        _body("messages"),
        {"x-sim-usage": "absent", "x-client-request-id": crid},
    )
    (delta,) = [d for n, d in events(raw.body) if n == "message_delta"]
    assert "usage" not in delta
    rec = await record_for(sim_port, crid)
    assert (rec["tokens_sent"], rec["usage_reported"]) == (20, None)

    raw = await post(sim_port, "/v1/chat/completions", CHAT, {"x-sim-usage": "absent"})
    assert "usage" not in orjson.loads(raw.body)


# -- content length -------------------------------------------------------------------------------


async def test_content_length_on_a_stream(sim_port: int) -> None:
    """x-sim-content-length: the stream has a Content-Length equal to its bytes, not chunked."""
    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/chat/completions",
        {**CHAT, "stream": True},
        {"x-sim-content-length": "1", "x-client-request-id": crid},
    )
    assert int(raw.headers["content-length"]) == len(raw.body)
    assert "transfer-encoding" not in raw.headers
    assert events(raw.body)[-1] == (None, "[DONE]")
    rec = await record_for(sim_port, crid)
    assert rec["content_length"] == len(raw.body)

    raw = await post(
        sim_port,
        "/v1/responses",
        _body("responses"),
        {"x-sim-content-length": "1", "x-sim-gzip": "1"},
    )
    assert int(raw.headers["content-length"]) == len(raw.body)
    assert events(gzip.decompress(raw.body))[-1][0] == "response.incomplete"


async def test_content_length_with_injected_disconnect_promises_more(sim_port: int) -> None:
    """With a reset mid-stream the Content-Length is that of the whole stream: the body is short."""
    crid = _crid()
    declared = None
    received = b""
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(
                f"http://127.0.0.1:{sim_port}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={
                    "x-sim-content-length": "1",
                    "x-sim-disconnect-after": "5",
                    "x-client-request-id": crid,
                },
            ) as resp:
                declared = int(resp.headers["Content-Length"])
                async for chunk in resp.content.iter_any():
                    received += chunk
    rec = await record_for(sim_port, crid)
    assert rec["ending"] == "injected_disconnect" and rec["tokens_sent"] == 5
    assert declared == rec["content_length"]
    assert declared is not None and len(received) < declared


# -- budgets --------------------------------------------------------------------------------------


async def test_ignore_max_tokens_generates_to_the_context_end(sim_port: int) -> None:
    """Without a budget a 'real vLLM' runs to the end of the context; the record shows why."""
    crid = _crid()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    raw = await post(
        sim_port,
        "/v1/chat/completions",
        body,
        {"x-sim-ignore-max-tokens": "1", "x-client-request-id": crid},
    )
    answer = orjson.loads(raw.body)
    rec = await record_for(sim_port, crid)
    assert rec["max_tokens_seen"] is None
    assert rec["tokens_sent"] == CONTEXT - rec["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == rec["tokens_sent"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert count_tokens(answer["choices"][0]["message"]["content"]) == rec["tokens_sent"]

    crid = _crid()
    await post(
        sim_port,
        "/v1/chat/completions",
        {**body, "max_completion_tokens": 9},
        {"x-sim-ignore-max-tokens": "1", "x-client-request-id": crid},
    )
    rec = await record_for(sim_port, crid)
    assert (rec["max_tokens_seen"], rec["tokens_sent"]) == (9, 9)

    crid = _crid()
    await post(sim_port, "/v1/chat/completions", body, {"x-client-request-id": crid})
    rec = await record_for(sim_port, crid)
    assert rec["tokens_sent"] == SimConfig().default_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_batch_prompts_generate_per_prompt(sim_port: int, stream: bool) -> None:
    """N prompts x n: one choice per prompt and n (index prompt_i * n + j); totals are exact."""
    crid = _crid()
    body = {
        "model": MODEL,
        "prompt": ["one", "two two", "three"],
        "n": 2,
        "max_tokens": 6,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    raw = await post(sim_port, "/v1/completions", body, {"x-client-request-id": crid})
    texts: dict[int, str] = {}
    if stream:
        usage = None
        for _, data in events(raw.body):
            if not isinstance(data, dict):
                continue
            for choice in data["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            usage = data.get("usage") or usage
    else:
        answer = orjson.loads(raw.body)
        texts = {c["index"]: c["text"] for c in answer["choices"]}
        usage = answer["usage"]
    assert sorted(texts) == list(range(6))
    assert all(count_tokens(t) == 6 for t in texts.values())
    assert len(set(texts.values())) == 6
    assert usage is not None and usage["completion_tokens"] == 36
    rec = await record_for(sim_port, crid)
    assert (rec["prompts"], rec["n"], rec["choices"]) == (3, 2, 6)
    assert rec["tokens_planned"] == rec["tokens_sent"] == 36


# -- injections on the typed-event APIs ------------------------------------------------------------


async def test_injections_on_responses_and_messages(sim_port: int) -> None:
    """Error event, malformed event and reset work on the typed-event streams too."""
    crid = _crid()
    raw = await post(
        sim_port,
        "/v1/messages",
        _body("messages"),
        {"x-sim-error-event-after": "3", "x-client-request-id": crid},
    )
    evs = events(raw.body)
    assert evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "api_error"
    assert count_tokens("".join(content_deltas("messages", evs))) == 3
    rec = await record_for(sim_port, crid)
    assert (rec["ending"], rec["tokens_sent"], rec["error"]) == (
        "error_status",
        3,
        "injected_error_event",
    )

    raw = await post(sim_port, "/v1/responses", _body("responses"), {"x-sim-malformed-after": "2"})
    assert b"event: response.output_text.delta\ndata: {not json\n\n" in raw.body
    assert raw.body.rstrip().endswith(b"}")

    crid = _crid()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(
                f"http://127.0.0.1:{sim_port}/v1/responses",
                json=_body("responses"),
                headers={"x-sim-disconnect-after": "4", "x-client-request-id": crid},
            ) as resp:
                async for _ in resp.content.iter_any():
                    pass
    rec = await record_for(sim_port, crid)
    assert (rec["ending"], rec["tokens_sent"], rec["api"]) == (
        "injected_disconnect",
        4,
        "responses",
    )
