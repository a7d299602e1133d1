"""Integration tests of the simulator's fault injection and disconnect ground truth."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
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
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
REPO = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim_port() -> AsyncIterator[int]:
    """A simulator with fast timings, served in-process on an ephemeral port."""
    runner: web.AppRunner
    runner, port = await start_sim(SimConfig(port=0, ttft_ms=1, itl_ms=1))
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


async def record_for(port: int, crid: str) -> dict[str, Any]:
    """The single final ground-truth record with client request id ``crid``."""
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


def _body(max_tokens: int, **extra: Any) -> bytes:
    return bytes(
        orjson.dumps(
            {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": max_tokens,
                "stream": True,
                **extra,
            }
        )
    )


async def test_injected_disconnect(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """x-sim-disconnect-after: K sends K tokens then resets; the SDK raises a connection error."""
    crid = _crid()
    received = ""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=50,
        stream=True,
        extra_headers={"x-client-request-id": crid, "x-sim-disconnect-after": "7"},
    )
    with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
        async for chunk in stream:
            for choice in chunk.choices:
                received += choice.delta.content or ""
    assert count_tokens(received) == 7
    rec = await record_for(sim_port, crid)
    assert rec["ending"] == "injected_disconnect"
    assert rec["tokens_sent"] == 7
    assert rec["tokens_planned"] == 50


async def test_injected_disconnect_raw_has_no_terminating_chunk(sim_port: int) -> None:
    """The injected disconnect is a transport abort: the chunked body never terminates."""
    crid = _crid()
    url = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    data = b""
    headers = {"x-client-request-id": crid, "x-sim-disconnect-after": "3"}
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.TransportError):
            async with http.stream("POST", url, content=_body(20), headers=headers) as resp:
                async for part in resp.aiter_raw():
                    data += part
    assert b"[DONE]" not in data
    assert b'finish_reason":"length' not in data
    assert (await record_for(sim_port, crid))["tokens_sent"] == 3


async def test_client_closes_stream_early(client: openai.AsyncOpenAI, sim_port: int) -> None:
    """Breaking out of the SDK stream and closing it is recorded as client_disconnected."""
    crid = _crid()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=400,
        stream=True,
        extra_headers={"x-client-request-id": crid, "x-sim-itl-ms": "20"},
    )
    got = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got == 5:
                break
    await stream.close()
    rec = await record_for(sim_port, crid)
    assert rec["ending"] == "client_disconnected"
    assert 5 <= rec["tokens_sent"] < rec["tokens_planned"] == 400
    assert rec["disconnected_at"] is not None
    assert rec["disconnected_at"] >= rec["last_token_at"]
    assert rec["ended_at"] == rec["disconnected_at"]


async def test_client_disconnect_before_first_token(sim_port: int) -> None:
    """A client that gives up during TTFT is recorded with tokens_sent 0."""
    crid = _crid()
    url = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    headers = {"x-client-request-id": crid, "x-sim-ttft-ms": "5000"}
    timeout = aiohttp.ClientTimeout(total=0.3)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(url, data=_body(10, stream=False), headers=headers) as resp:
                await resp.read()
    rec = await record_for(sim_port, crid)
    assert rec["ending"] == "client_disconnected"
    assert rec["tokens_sent"] == 0
    assert rec["disconnected_at"] is not None and rec["first_token_at"] is None


async def test_malformed_event_visible_in_raw_bytes(sim_port: int) -> None:
    """x-sim-malformed-after emits a broken SSE event, then the stream continues and ends."""
    crid = _crid()
    url = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    headers = {"x-client-request-id": crid, "x-sim-malformed-after": "4"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=_body(10), headers=headers) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    events = raw.split(b"\n\n")
    assert b"data: {not json" in events
    bad = events.index(b"data: {not json")
    before = [orjson.loads(e[6:]) for e in events[:bad]]
    assert sum(count_tokens(e["choices"][0]["delta"].get("content") or "") for e in before) == 4
    assert raw.endswith(b"data: [DONE]\n\n")
    rec = await record_for(sim_port, crid)
    assert (rec["ending"], rec["tokens_sent"]) == ("completed", 10)


async def test_error_event_ends_stream(sim_port: int) -> None:
    """x-sim-error-event-after emits an OpenAI error event after K tokens and ends the stream."""
    crid = _crid()
    url = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    headers = {"x-client-request-id": crid, "x-sim-error-event-after": "6"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=_body(30), headers=headers) as resp,
    ):
        raw = await resp.read()
    events = [e for e in raw.split(b"\n\n") if e]
    last = orjson.loads(events[-1][6:])
    assert set(last["error"]) == {"message", "type", "param", "code"}
    assert b"[DONE]" not in raw
    rec = await record_for(sim_port, crid)
    assert (rec["ending"], rec["tokens_sent"]) == ("error_status", 6)


async def test_error_event_surfaces_in_sdk(client: openai.AsyncOpenAI) -> None:
    """The in-stream error event makes the openai SDK raise an APIError."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=30,
        stream=True,
        extra_headers={"x-sim-error-event-after": "2"},
    )
    with pytest.raises(openai.APIError):
        async for _chunk in stream:
            pass


async def test_slow_start_and_overrides_recorded(sim_port: int) -> None:
    """Slow start delays the headers; x-* headers are recorded lower-case."""
    crid = _crid()
    url = f"http://127.0.0.1:{sim_port}/v1/chat/completions"
    headers = {"X-Client-Request-Id": crid, "X-Sim-Slow-Start-Ms": "30", "X-Sim-Itl-Ms": "0"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, data=_body(5), headers=headers) as resp,
    ):
        await resp.read()
    rec = await record_for(sim_port, crid)
    assert rec["headers_seen"]["x-sim-slow-start-ms"] == "30"
    assert rec["first_token_at"] - rec["started_at"] >= 0.03
    assert rec["ending"] == "completed"


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_usage_under_reports_the_prompt(
    client: openai.AsyncOpenAI, sim_port: int, stream: bool
) -> None:
    """x-sim-prompt-usage: scale:0.04 reports 4 % of the prompt in the usage (stream and
    JSON), the record keeps the truth beside what was claimed; a bad value is a 400."""
    crid = _crid()
    messages: Any = [{"role": "user", "content": "Tell me a long story. " * 100}]
    headers = {"x-client-request-id": crid, "x-sim-prompt-usage": "scale:0.04"}
    if stream:
        chunks = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
        )
        usage = [c.usage async for c in chunks if c.usage is not None][-1]
    else:
        answer = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, extra_headers=headers
        )
        assert answer.usage is not None
        usage = answer.usage
    rec = await record_for(sim_port, crid)
    assert rec["prompt_tokens"] > 500
    assert (
        usage.prompt_tokens == rec["prompt_tokens_reported"] == round(rec["prompt_tokens"] * 0.04)
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="x-sim-prompt-usage"):
        await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            extra_headers={"x-sim-prompt-usage": "absent"},
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_serves_and_exits_zero_on_sigterm() -> None:
    """`python -m extproc.sim` serves requests and exits 0 on SIGTERM."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc.sim", "--port", str(port), "--log-format", "json"],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(200):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 3},
            headers={"x-sim-ttft-ms": "0", "x-sim-itl-ms": "0"},
        )
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert b'"event": "sim_listening"' in err


def test_cli_help() -> None:
    """`python -m extproc.sim --help` documents the flags."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "extproc.sim", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    for flag in (
        "--ttft-ms",
        "--itl-ms",
        "--text-mode",
        "--config",
        "--log-format",
        "x-sim-status",
    ):
        assert flag in out


async def test_disconnect_noticed_during_inter_token_sleep(
    client: openai.AsyncOpenAI, sim_port: int
) -> None:
    """A close during a long inter-token gap is recorded before the next token was due."""
    crid = _crid()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        extra_headers={"x-client-request-id": crid, "x-sim-itl-ms": "3000"},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    rec = await record_for(sim_port, crid)
    assert rec["ending"] == "client_disconnected"
    assert rec["tokens_sent"] == 1
    # the next token was due 3 s after the first; the cut must be seen long before that
    assert rec["disconnected_at"] - rec["last_token_at"] < 2.5
