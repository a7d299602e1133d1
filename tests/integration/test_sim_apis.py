"""Integration tests: Responses, Anthropic Messages and embeddings APIs of the simulator.

Driven by the official SDKs (openai for responses and embeddings, anthropic for messages); the
text the SDK observed is compared with the simulator's ground-truth record.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from anthropic.types import MessageParam

from extproc.sim.app import start_sim
from extproc.sim.config import SimConfig
from extproc.sim.prompt_tokens import messages_prompt_tokens, responses_prompt_tokens
from extproc.sim.text import count_tokens
from extproc.sim.wire.base import TOOL_NAME

pytestmark = pytest.mark.integration

MODEL = "sim-small"
USER: list[MessageParam] = [{"role": "user", "content": "Tell me about quotas. 讲个故事"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim_port() -> AsyncIterator[int]:
    """A fast simulator served in-process on an ephemeral port."""
    runner: web.AppRunner
    runner, port = await start_sim(SimConfig(port=0, ttft_ms=1, itl_ms=0.2))
    yield port
    await runner.cleanup()


@pytest.fixture
async def oai(sim_port: int) -> AsyncIterator[openai.AsyncOpenAI]:
    """openai SDK client without retries (closed after the test)."""
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{sim_port}/v1", api_key="x", max_retries=0
    ) as c:
        yield c


@pytest.fixture
async def claude(sim_port: int) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """anthropic SDK client without retries (closed after the test)."""
    async with anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{sim_port}", api_key="x", max_retries=0
    ) as c:
        yield c


def _hdr(crid: str, **extra: str) -> dict[str, str]:
    return {"x-client-request-id": crid, **{k.replace("_", "-"): v for k, v in extra.items()}}


def _crid() -> str:
    return f"t-{uuid.uuid4().hex}"


async def record_for(port: int, crid: str) -> dict[str, Any]:
    """The final ground-truth record of ``crid``."""
    async with aiohttp.ClientSession() as http:
        for _ in range(500):
            url = f"http://127.0.0.1:{port}/sim/requests"
            async with http.get(url, params={"client_request_id": crid}) as resp:
                records = (await resp.json())["requests"]
            if records and records[0]["ending"] != "in_progress":
                assert len(records) == 1
                return dict(records[0])
            await asyncio.sleep(0.01)
    raise AssertionError(f"no final record for {crid}")


# -- Responses API -------------------------------------------------------------------------------


async def test_responses_non_streaming(oai: openai.AsyncOpenAI, sim_port: int) -> None:
    """A Response object: output_text token count = usage = ground truth; budget → incomplete."""
    crid = _crid()
    resp = await oai.responses.create(
        model=MODEL,
        input="Tell me about quotas.",
        instructions="Be brief.",
        max_output_tokens=25,
        extra_headers=_hdr(crid),
    )
    assert resp.object == "response"
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None
    assert count_tokens(resp.output_text) == resp.usage.output_tokens == 25
    assert resp.usage.input_tokens == responses_prompt_tokens("Be brief.", "Tell me about quotas.")
    assert resp.usage.total_tokens == resp.usage.input_tokens + 25
    rec = await record_for(sim_port, crid)
    assert (rec["api"], rec["stream"], rec["tokens_sent"]) == ("responses", False, 25)
    assert (rec["max_tokens_seen"], rec["usage_reported"]) == (25, 25)
    assert rec["prompt_tokens"] == resp.usage.input_tokens

    short = await oai.responses.create(
        model=MODEL, input="hi", max_output_tokens=25, extra_headers={"x-sim-tokens": "5"}
    )
    assert short.status == "completed"
    assert short.usage is not None and short.usage.output_tokens == 5


async def test_responses_stream_text(oai: openai.AsyncOpenAI, sim_port: int) -> None:
    """create(stream=True): one token per output_text.delta, usage in the terminal event."""
    crid = _crid()
    stream = await oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        max_output_tokens=30,
        stream=True,
        extra_headers=_hdr(crid, x_sim_tokens="18"),
    )
    types: list[str] = []
    deltas: list[str] = []
    seqs: list[int] = []
    final: Any = None
    async for event in stream:
        types.append(event.type)
        seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert seqs == list(range(len(seqs)))
    assert all(count_tokens(d) == 1 for d in deltas)
    assert final.usage.output_tokens == len(deltas) == 18
    assert final.output_text == "".join(deltas)
    rec = await record_for(sim_port, crid)
    assert (rec["api"], rec["stream"], rec["tokens_sent"], rec["ending"]) == (
        "responses",
        True,
        18,
        "completed",
    )


async def test_responses_stream_reasoning_and_function_call(
    oai: openai.AsyncOpenAI, sim_port: int
) -> None:
    """The stream helper assembles a reasoning item and a function_call from the deltas."""
    crid = _crid()
    async with oai.responses.stream(
        model=MODEL,
        input="call the tool",
        max_output_tokens=40,
        extra_headers=_hdr(crid, x_sim_reasoning="6", x_sim_tool_call="1", x_sim_tokens="20"),
    ) as stream:
        reasoning = ""
        arguments = ""
        async for event in stream:
            if event.type == "response.reasoning_text.delta":
                reasoning += event.delta
            elif event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = await stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    call = final.output[1]
    assert call.type == "function_call"
    assert call.name == TOOL_NAME and call.arguments == arguments
    assert count_tokens(reasoning) == 6
    assert count_tokens(reasoning) + count_tokens(arguments) == 20
    assert final.usage is not None
    assert final.usage.output_tokens == 20
    assert final.usage.output_tokens_details.reasoning_tokens == 6
    rec = await record_for(sim_port, crid)
    assert rec["tokens_sent"] == 20


# -- Anthropic Messages API ----------------------------------------------------------------------


async def test_messages_non_streaming(claude: anthropic.AsyncAnthropic, sim_port: int) -> None:
    """messages.create: text token count = usage.output_tokens = ground truth."""
    crid = _crid()
    msg = await claude.messages.create(
        model=MODEL,
        max_tokens=22,
        system="Be brief.",
        messages=USER,
        extra_headers=_hdr(crid),
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.stop_reason == "max_tokens"
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert count_tokens(text) == msg.usage.output_tokens == 22
    assert msg.usage.input_tokens == messages_prompt_tokens("Be brief.", list(USER))
    assert msg.usage.cache_read_input_tokens == 0
    rec = await record_for(sim_port, crid)
    assert (rec["api"], rec["tokens_sent"], rec["max_tokens_seen"]) == ("messages", 22, 22)

    short = await claude.messages.create(
        model=MODEL,
        max_tokens=22,
        messages=USER,
        extra_headers={"x-sim-tokens": "4"},
    )
    assert short.stop_reason == "end_turn" and short.usage.output_tokens == 4


async def test_messages_stream_text(claude: anthropic.AsyncAnthropic, sim_port: int) -> None:
    """messages.stream: text deltas of one token; final usage = ground truth."""
    crid = _crid()
    async with claude.messages.stream(
        model=MODEL,
        max_tokens=30,
        messages=USER,
        extra_headers=_hdr(crid, x_sim_tokens="17"),
    ) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert all(count_tokens(p) == 1 for p in pieces)
    assert len(pieces) == 17
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 17
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    rec = await record_for(sim_port, crid)
    assert (rec["api"], rec["stream"], rec["tokens_sent"]) == ("messages", True, 17)


async def test_messages_stream_raw_events_thinking_and_tool(
    claude: anthropic.AsyncAnthropic, sim_port: int
) -> None:
    """create(stream=True) yields the Anthropic event sequence; tool input is valid JSON."""
    crid = _crid()
    stream = await claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=USER,
        stream=True,
        extra_headers=_hdr(crid, x_sim_reasoning="5", x_sim_tool_call="1", x_sim_tokens="25"),
    )
    types: list[str] = []
    thinking = ""
    partial = ""
    start_usage: Any = None
    end_usage: Any = None
    async for event in stream:
        types.append(event.type)
        if event.type == "message_start":
            start_usage = event.message.usage
        elif event.type == "content_block_delta":
            if event.delta.type == "thinking_delta":
                thinking += event.delta.thinking
            elif event.delta.type == "input_json_delta":
                partial += event.delta.partial_json
        elif event.type == "message_delta":
            end_usage = event.usage
            assert event.delta.stop_reason == "tool_use"
    assert types[:2] == ["message_start", "content_block_start"]  # the SDK drops "ping"
    assert types[-2:] == ["message_delta", "message_stop"]
    assert start_usage.output_tokens == 1
    assert set(orjson.loads(partial)) == {"text"}
    assert count_tokens(thinking) == 5
    assert count_tokens(thinking) + count_tokens(partial) == end_usage.output_tokens == 25
    rec = await record_for(sim_port, crid)
    assert rec["tokens_sent"] == 25


async def test_messages_stream_helper_with_tool(
    claude: anthropic.AsyncAnthropic, sim_port: int
) -> None:
    """The SDK's stream accumulator parses the partial JSON into the tool_use input."""
    async with claude.messages.stream(
        model=MODEL,
        max_tokens=40,
        messages=USER,
        extra_headers={"x-sim-tool-call": "1", "x-sim-reasoning": "3"},
    ) as stream:
        final = await stream.get_final_message()
    kinds = [b.type for b in final.content]
    assert kinds == ["thinking", "tool_use"]
    tool = final.content[1]
    assert tool.type == "tool_use" and tool.name == TOOL_NAME
    assert isinstance(tool.input, dict) and isinstance(tool.input["text"], str)
    assert final.usage.output_tokens == 40


async def test_messages_errors_use_anthropic_shape(
    claude: anthropic.AsyncAnthropic, sim_port: int
) -> None:
    """Missing max_tokens is a 400 in Anthropic's error shape; injected 429 maps to the SDK."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://127.0.0.1:{sim_port}/v1/messages",
            json={"model": MODEL, "messages": USER},
        ) as resp,
    ):
        assert resp.status == 400
        body = await resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.RateLimitError) as err:
        await claude.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=USER,
            extra_headers={"x-sim-status": "429"},
        )
    assert err.value.body is not None
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.create(
            model="nope",
            max_tokens=5,
            messages=USER,
        )


# -- embeddings ----------------------------------------------------------------------------------


async def test_embeddings(oai: openai.AsyncOpenAI, sim_port: int) -> None:
    """Deterministic vectors (SDK default base64 and float), usage = recorded input tokens."""
    crid = _crid()
    inputs = ["the quota gateway", "讲个故事"]
    res = await oai.embeddings.create(model=MODEL, input=inputs, extra_headers=_hdr(crid))
    assert [d.index for d in res.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in res.data)
    expected = sum(count_tokens(t) for t in inputs)
    assert res.usage.prompt_tokens == res.usage.total_tokens == expected
    rec = await record_for(sim_port, crid)
    assert (rec["api"], rec["prompt_tokens"], rec["tokens_sent"]) == ("embeddings", expected, 0)

    floats = await oai.embeddings.create(
        model=MODEL, input="the quota gateway", dimensions=5, encoding_format="float"
    )
    vec = floats.data[0].embedding
    assert len(vec) == 5
    assert abs(sum(v * v for v in vec) - 1.0) < 1e-9
    again = await oai.embeddings.create(
        model=MODEL, input="the quota gateway", dimensions=5, encoding_format="float"
    )
    assert again.data[0].embedding == vec
    ids = await oai.embeddings.create(model=MODEL, input=[[1, 2, 3], [4]])
    assert ids.usage.prompt_tokens == 4

    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"http://127.0.0.1:{sim_port}/v1/embeddings",
            json={"model": MODEL, "input": "x", "encoding_format": "base64"},
        ) as resp,
    ):
        raw = (await resp.json())["data"][0]["embedding"]
    decoded = struct.unpack("<8f", base64.b64decode(raw))
    assert abs(sum(v * v for v in decoded) - 1.0) < 1e-5


async def test_models_and_health_routes(sim_port: int) -> None:
    """/v1/models, /health and /healthz answer (passthrough examples)."""
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/models", "/health", "/healthz"):
            async with http.get(f"http://127.0.0.1:{sim_port}{path}") as resp:
                assert resp.status == 200, path
