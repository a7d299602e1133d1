"""A lean aiohttp client for the benchmarks: one request, timed, with minimal parsing.

The openai SDK costs far more CPU per event than what is measured here, so events (split by the
gateway's own :class:`~extproc.core.sse.SSEDecoder`, any line ending) are not parsed as JSON:
an event carries content when it has a non-empty ``"content":"..."`` (the simulator writes
exactly one token per content event), a quota cut is an event with an ``"error"`` object, and
``data: [DONE]`` ends the stream.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from extproc.core.sse import SSEDecoder, SSEEvent
from extproc.load.prompt import base_prompt
from extproc.load.sse import DONE, MAX_EVENT_BYTES

_CONTENT = re.compile(rb'"content":\s?"(?!")')


@dataclass
class Result:
    """What the client saw of one request (times: ``perf_counter`` s unless noted)."""

    status: int = 0
    latency: float = 0.0
    ttft: float | None = None
    first_chunk_at: float | None = None
    last_chunk_at: float | None = None
    tokens: int = 0
    done: bool = False
    cut: bool = False
    cut_wall: float | None = None  # time.time() when the error event arrived
    error: str = ""
    client_request_id: str = ""

    @property
    def mean_gap(self) -> float | None:
        """Mean delay between content chunks (reads that carry several share a timestamp)."""
        if self.tokens < 2 or self.first_chunk_at is None or self.last_chunk_at is None:
            return None
        return (self.last_chunk_at - self.first_chunk_at) / (self.tokens - 1)


@dataclass(frozen=True)
class Shape:
    """The request to send: prompt size, answer length, simulator timing, stream or not."""

    prompt_tokens: int = 1000
    max_tokens: int = 16
    stream: bool = False
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    extra_headers: tuple[tuple[str, str], ...] = field(default=())
    model: str = "sim-small"

    def body(self, n: int = 0) -> bytes:
        """The JSON body of request ``n`` (the prompt text is the same apart from a prefix)."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"{n} {base_prompt(self.prompt_tokens)}"}],
            "max_tokens": self.max_tokens,
        }
        if self.stream:
            payload["stream"] = True
        return bytes(orjson.dumps(payload))

    def headers(self, key: str, client_request_id: str = "") -> dict[str, str]:
        """Authorization, content type and the simulator's ``x-sim-*`` timing overrides."""
        h = {
            "authorization": f"Bearer {key}",
            "content-type": "application/json",
            "x-sim-tokens": str(self.max_tokens),
            "x-sim-ttft-ms": f"{self.ttft_ms:g}",
            "x-sim-itl-ms": f"{self.itl_ms:g}",
        }
        if client_request_id:
            h["x-client-request-id"] = client_request_id
        h.update(dict(self.extra_headers))
        return h


async def send(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    shape: Shape,
    *,
    body: bytes | None = None,
    client_request_id: str = "",
    limit_s: float = 60.0,
) -> Result:
    """Send one chat completion to ``url`` (``.../v1``) and time it."""
    res = Result(client_request_id=client_request_id)
    data = body if body is not None else shape.body()
    t0 = time.perf_counter()
    try:
        async with session.post(
            f"{url}/chat/completions",
            data=data,
            headers=shape.headers(key, client_request_id),
            timeout=aiohttp.ClientTimeout(total=limit_s),
        ) as resp:
            res.status = resp.status
            if not shape.stream or resp.status != 200:
                await resp.read()
            else:
                await _read_stream(resp, res, t0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.error = type(exc).__name__
    res.latency = time.perf_counter() - t0
    return res


async def _read_stream(resp: aiohttp.ClientResponse, res: Result, t0: float) -> None:
    decoder = SSEDecoder(max_event_bytes=MAX_EVENT_BYTES)
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        for ev in decoder.feed(piece):
            _on_event(ev, res, now, t0)
        if res.cut:  # the gateway aborts the response after a cut's error event
            return
    for ev in decoder.flush():
        _on_event(ev, res, time.perf_counter(), t0)


def _on_event(ev: SSEEvent, res: Result, now: float, t0: float) -> None:
    if ev.data is None:
        return
    if ev.data == DONE:
        res.done = True
    elif _CONTENT.search(ev.raw):
        res.tokens += 1
        if res.first_chunk_at is None:
            res.first_chunk_at = now
            res.ttft = now - t0
        res.last_chunk_at = now
    elif b'"error"' in ev.raw:
        res.cut = True
        res.cut_wall = time.time()


def connector(limit: int) -> aiohttp.TCPConnector:
    """A keep-alive connector sized for ``limit`` concurrent requests."""
    return aiohttp.TCPConnector(limit=limit, force_close=False, enable_cleanup_closed=True)
