"""Integration tests: the simulator in-process on a free port, driven by the real openai SDK."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp import web

from extproc.sim.app import start_sim
from extproc.sim.config import SimConfig
from extproc.sim.prompt_tokens import chat_prompt_tokens
from extproc.sim.text import count_tokens

pytestmark = pytest.mark.integration

MODEL = "sim-small"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Tell me a story about quotas. 讲个故事"},
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim_port() -> AsyncIterator[int]:
    """A simulator with fast timings, served in-process on an ephemeral port."""
    runner: web.AppRunner
    runner, port = await start_sim(
        SimConfig(port=0, ttft_ms=2, itl_ms=0.5, models=("sim-small", "sim-large"))
    )
    yield port
    await runner.cleanup()


@pytest.fixture
async def client(sim_port: int) -> AsyncIterator[openai.AsyncOpenAI]:
    """An openai SDK client pointed at the simulator, without retries (closed after the test)."""
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{sim_port}/v1", api_key="x", max_retries=0
    ) as c:
        yield c


def _crid() -> str:
    return f"t-{uuid.uuid4().hex}"


async def record_for(port: int, crid: str, *, wait_final: bool = True) -> dict[str, Any]:
    """The single ground-truth record with client request id ``crid`` (waits for its ending)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(500):
            url = f"http://127.0.0.1:{port}/sim/requests"
            async with http.get(url, params={"client_request_id": crid}) as resp:
                records = (await resp.json())["requests"]
            if records and (not wait_final or records[0]["ending"] != "in_progress"):
                assert len(records) == 1
                return dict(records[0])
            await asyncio.sleep(0.01)
    raise AssertionError(f"no final record for {crid}")


async def test_models_and_health(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """/v1/models lists the configured models in OpenAI format; /healthz answers ok."""
    models = [m.id async for m in client.models.list()]
    assert models == ["sim-small", "sim-large"]
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{sim_port}/healthz") as resp,
    ):
        assert resp.status == 200


async def test_non_streaming_chat_usage_is_token_exact(
    client: openai.AsyncOpenAI, sim_port: int
) -> None:
    """Non-streaming chat: usage.completion_tokens equals the cl100k count of the text."""
    crid = _crid()
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=37,
        extra_headers={
            "x-client-request-id": crid,
            "x-request-id": "req-1",
            "x-quota-tenant": "t1",
        },
    )
    assert resp.object == "chat.completion"
    text = resp.choices[0].message.content
    assert text is not None
    assert resp.usage is not None
    assert resp.usage.completion_tokens == count_tokens(text) == 37
    assert resp.usage.prompt_tokens == chat_prompt_tokens(MESSAGES)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 37
    assert resp.choices[0].finish_reason == "length"
    rec = await record_for(sim_port, crid)
    assert rec["ending"] == "completed"
    assert rec["tokens_sent"] == rec["tokens_planned"] == 37
    assert (rec["request_id"], rec["tenant"], rec["stream"]) == ("req-1", "t1", False)
    assert rec["headers_seen"]["x-quota-tenant"] == "t1"
    assert rec["status"] == 200
    assert rec["first_token_at"] is not None and rec["ended_at"] is not None


async def test_streaming_chat_with_usage(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """Streaming chat: summed delta tokens == usage.completion_tokens == record.tokens_sent."""
    crid = _crid()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-client-request-id": crid, "x-sim-tokens-per-chunk": "3"},
    )
    roles: list[str] = []
    pieces: list[str] = []
    finish: list[str] = []
    usage = None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            pieces.append(delta.content)
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    assert roles == ["assistant"]
    assert finish == ["length"]
    assert usage is not None
    assert sum(count_tokens(p) for p in pieces) == count_tokens("".join(pieces)) == 120
    assert all(count_tokens(p) == 3 for p in pieces)
    assert usage.completion_tokens == 120
    rec = await record_for(sim_port, crid)
    assert rec["tokens_sent"] == 120
    assert rec["ending"] == "completed"
    assert rec["include_usage"] is True


async def test_x_sim_tokens_shorter_answer_stops(client: openai.AsyncOpenAI) -> None:
    """x-sim-tokens below max_tokens gives a shorter answer with finish_reason stop."""
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=100, extra_headers={"x-sim-tokens": "9"}
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == 9


async def test_seed_header_determinism(client: openai.AsyncOpenAI) -> None:
    """The same x-sim-seed gives the same text; a different seed gives different text."""

    async def text(seed: str) -> str:
        resp = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, extra_headers={"x-sim-seed": seed}
        )
        return resp.choices[0].message.content or ""

    assert await text("5") == await text("5")
    assert await text("5") != await text("6")


async def test_completions_endpoint(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """/v1/completions works streaming and non-streaming with exact usage."""
    resp = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=25,
        extra_headers={"x-sim-tool-call": "1", "x-sim-reasoning": "5"},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.object == "text_completion"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == count_tokens(resp.choices[0].text) == 25
    assert resp.usage.prompt_tokens == count_tokens("Once upon a time")
    crid = _crid()
    stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-client-request-id": crid},
    )
    text = ""
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
    assert usage is not None and usage.completion_tokens == count_tokens(text) == 30
    rec = await record_for(sim_port, crid)
    assert rec["path"] == "/v1/completions" and rec["tokens_sent"] == 30


async def test_n_choices(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """n=2 yields two distinct choices; completion_tokens counts both (streaming too)."""
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=15, n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    texts = [c.message.content or "" for c in resp.choices]
    assert texts[0] != texts[1]
    assert resp.usage is not None and resp.usage.completion_tokens == 30
    crid = _crid()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=15,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-client-request-id": crid},
    )
    per_choice: dict[int, str] = {0: "", 1: ""}
    order: list[int] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                per_choice[choice.index] += choice.delta.content
                order.append(choice.index)
    assert per_choice[0] == texts[0] and per_choice[1] == texts[1]
    assert order[:4] == [0, 1, 0, 1]
    assert usage is not None and usage.completion_tokens == 30
    assert (await record_for(sim_port, crid))["tokens_sent"] == 30


async def test_reasoning_stream(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """x-sim-reasoning: K streams K reasoning tokens before content; all count as output."""
    crid = _crid()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-client-request-id": crid, "x-sim-reasoning": "12"},
    )
    reasoning = ""
    content = ""
    kinds: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning += extra["reasoning_content"]
                kinds.append("r")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("c")
    assert kinds == ["r"] * 12 + ["c"] * 38
    assert count_tokens(reasoning) == 12 and count_tokens(content) == 38
    assert usage is not None and usage.completion_tokens == 50
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 12
    assert (await record_for(sim_port, crid))["tokens_sent"] == 50


async def test_tool_call_stream(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """x-sim-tool-call streams the answer as tool-call arguments with finish_reason tool_calls."""
    crid = _crid()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-client-request-id": crid, "x-sim-tool-call": "1"},
    )
    args = ""
    ids: list[str] = []
    names: list[str] = []
    finish: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                if call.id:
                    ids.append(call.id)
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    args += call.function.arguments
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert len(ids) == 1 and names == ["sim_tool"]
    assert finish == ["tool_calls"]
    assert count_tokens(args) == 20
    assert usage is not None and usage.completion_tokens == 20
    assert (await record_for(sim_port, crid))["tokens_sent"] == 20
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, extra_headers={"x-sim-tool-call": "1"}
    )
    calls = resp.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert resp.choices[0].finish_reason == "tool_calls"


async def test_errors_map_to_sdk_exceptions(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """x-sim-status and unknown models produce OpenAI error bodies the SDK maps to exceptions."""
    crid = _crid()
    with pytest.raises(openai.RateLimitError) as rate:
        await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            extra_headers={"x-sim-status": "429", "x-client-request-id": crid},
        )
    assert rate.value.status_code == 429
    assert isinstance(rate.value.body, dict) and rate.value.body["code"] == "rate_limit_exceeded"
    rec = await record_for(sim_port, crid)
    assert (rec["ending"], rec["status"], rec["tokens_sent"]) == ("error_status", 429, 0)
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_headers={"x-sim-status": "503"}
        )
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)


async def test_bad_json_returns_openai_error(sim_port: int) -> None:
    """A body that is not JSON gets a 400 with the OpenAI error shape."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://127.0.0.1:{sim_port}/v1/chat/completions", data=b"{nope") as resp,
    ):
        assert resp.status == 400
        body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


async def test_record_endpoints(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """/sim/requests/{id}, /sim/stats and DELETE /sim/requests behave as documented."""
    crid = _crid()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"x-client-request-id": crid}
    )
    sim_id = raw.headers["x-sim-id"]
    base = f"http://127.0.0.1:{sim_port}/sim"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/requests/{sim_id}") as resp:
            rec = await resp.json()
        assert rec["sim_id"] == sim_id and rec["client_request_id"] == crid
        async with http.get(f"{base}/requests/sim-nope") as resp:
            assert resp.status == 404
        async with http.get(f"{base}/stats") as resp:
            stats = await resp.json()
        assert stats["requests"] >= 1 and stats["tokens_sent"] >= 3
        async with http.delete(f"{base}/requests") as resp:
            assert resp.status == 200
        async with http.get(f"{base}/requests") as resp:
            assert (await resp.json())["requests"] == []
