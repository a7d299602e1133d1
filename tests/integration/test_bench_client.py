"""The bench client reads streams with the gateway's SSE decoder: CRLF, CR and LF line ends and
events split anywhere across reads all count the same (a real aiohttp server on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from extproc.bench.client import Shape, connector, send

pytestmark = pytest.mark.integration


def _event(obj: object, eol: str) -> bytes:
    return f"data: {orjson.dumps(obj).decode()}{eol}{eol}".encode()


def _transcript(eol: str, *, cut: bool) -> bytes:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        *({"choices": [{"index": 0, "delta": {"content": f"tok{i}"}}]} for i in range(5)),
    ]
    out = f": keep-alive comment{eol}{eol}".encode()
    out += b"".join(_event(c, eol) for c in chunks)
    if cut:  # the gateway's cut: event: error, a comment, the error; no [DONE] after it
        error = _event({"error": {"type": "tokens", "code": "tpm_limit_exceeded"}}, eol)
        return out + f"event: error{eol}: quota gone{eol}".encode() + error
    return out + f"data: [DONE]{eol}{eol}".encode()


@pytest.fixture
async def sse_server() -> AsyncIterator[str]:
    """``POST /{eol}/{cut}/v1/chat/completions`` streams the transcript 3 bytes per write."""

    async def handler(request: web.Request) -> web.StreamResponse:
        eol = {"crlf": "\r\n", "lf": "\n", "cr": "\r"}[request.match_info["eol"]]
        body = _transcript(eol, cut=request.match_info["cut"] == "cut")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), 3):
            await resp.write(body[i : i + 3])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/{eol}/{cut}/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("eol", ["crlf", "lf", "cr"])
@pytest.mark.parametrize("cut", ["cut", "whole"])
async def test_stream_counted_for_every_line_ending(sse_server: str, eol: str, cut: str) -> None:
    async with aiohttp.ClientSession(connector=connector(4)) as session:
        res = await send(session, f"{sse_server}/{eol}/{cut}/v1", "sk-x", Shape(stream=True))
    assert res.status == 200 and res.error == ""
    assert res.tokens == 5  # the empty role delta carries no content
    assert res.done is (cut == "whole")
    assert res.cut is (cut == "cut")
    assert res.ttft is not None and res.first_chunk_at is not None
