"""The per-request processor driven message by message with real ext_proc protobufs and the
in-memory limiter, its stream charges answering after varying numbers of event-loop turns:
nothing is lost or stalled whatever order charges answer in."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.core.lifecycle import Closed, Ending
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from extproc.server.servicer import ExternalProcessorServicer
from tests.limiters import RecordingLimiter

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
charging: {charge_every_tokens: 4, streaming: %s}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: %d}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def headers(pairs: dict[str, str], *, eos: bool = False) -> Any:
    hh = pb.HttpHeaders(end_of_stream=eos)
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


def event(word: str) -> bytes:
    obj = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": word}}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def limiter() -> RecordingLimiter:
    """The in-memory limiter (on the fake clock the gateway gets too), its stream charges
    answering after 0 to 7 event-loop turns."""
    return RecordingLimiter(MemoryLimiter(FakeClock()), delays=(0, 1, 3, 7, 2))


async def start(
    limiter: RecordingLimiter, streaming: str = "lazy", tpm: int = 100000
) -> RequestProcessor:
    cfg = load_config_text(RULES % (streaming, tpm))
    gw = Gateway(config=cfg, limiter=limiter, clock=limiter.inner.clock, metrics=Metrics())
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "x-request-id": "r1",
                }
            )
        )
    )
    body = orjson.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    [resp] = await proc.handle(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    assert resp.WhichOneof("response") == "request_body"
    [resp] = await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "text/event-stream"})
        )
    )
    assert resp.mode_override.response_body_mode == 4  # FULL_DUPLEX_STREAMED
    return proc


def forwarded(resps: list[Any]) -> tuple[bytes, bool]:
    data = b""
    eos = False
    for r in resps:
        sr = r.response_body.response.body_mutation.streamed_response
        data += sr.body
        eos = eos or sr.end_of_stream
    return data, eos


async def feed(proc: RequestProcessor, chunk: bytes, end: bool = False) -> list[Any]:
    return await proc.handle(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end))
    )


async def test_lazy_answers_between_chunks_lose_nothing() -> None:
    """Charges answering between chunks never drop or delay events; the stream ends whole."""
    lim = limiter()
    proc = await start(lim)
    words = [f" w{i}" for i in range(40)]
    sent = b""
    got: list[Any] = []
    for i, w in enumerate(words):
        ev = event(w)
        sent += ev
        got += await feed(proc, ev)
        for _ in range(i % 4):
            await asyncio.sleep(0)  # time passes between chunks: some charges answer
    got += await feed(proc, b"data: [DONE]\n\n", end=True)
    data, eos = forwarded(got)
    assert data == sent + b"data: [DONE]\n\n"
    assert eos
    assert proc.driver is not None
    assert sum(lim.charges) <= proc.driver.meter.delivered


async def test_strict_holds_then_releases_in_order() -> None:
    """Strict: events beyond the lease wait for the renewal and then go out in order."""
    lim = limiter()
    proc = await start(lim, "strict")
    sent = b""
    got: list[Any] = []
    feeder = []
    for i in range(12):
        ev = event(f" s{i}")
        sent += ev
        feeder.append(ev)
    got += await feed(proc, b"".join(feeder))
    got += await feed(proc, b"data: [DONE]\n\n", end=True)
    data, eos = forwarded(got)
    assert data == sent + b"data: [DONE]\n\n" and eos


async def test_strict_refused_renewal_cuts_with_error_event() -> None:
    """A renewal granting nothing ends the stream with an error event, then an immediate
    response that makes Envoy abort the started response (no [DONE], no clean end)."""
    lim = limiter()
    proc = await start(lim, "strict")
    # other requests took the hour's TPM but 4 tokens: the next lease grants 4, then none
    [tpm] = [b for b in lim.admits[0] if b.kind == "tpm"]
    lim.inner.seed_counter(tpm.key, tpm.limit - 4)
    got = await feed(proc, b"".join(event(f" x{i}") for i in range(20)))
    data, eos = forwarded(got[:-1])
    assert not eos
    last = data.rsplit(b"\n\n", 2)[-2]
    assert last.startswith(b"event: error\n: Rate limit reached for tokens")
    assert b'"code":"tpm_limit_exceeded"' in last
    assert b"[DONE]" not in data
    abort = got[-1]
    assert abort.WhichOneof("response") == "immediate_response"
    assert abort.immediate_response.details == "ai_quota_stream_cut"
    assert proc.driver is not None and proc.driver.meter.delivered <= 8


async def test_settlement_happens_once() -> None:
    """A stream closed twice (Envoy cancels, then the servicer's finally) settles once."""
    lim = limiter()
    proc = await start(lim)
    await feed(proc, event(" a") + event(" b"))
    proc.close(Closed.CANCELLED)
    proc.close(Closed.EOF)
    await asyncio.gather(*proc.gw.background.pending)
    assert len(lim.settles) == 1
    assert proc.s.life.ending is Ending.CLIENT_DISCONNECTED


class _GoneStream:
    """A gRPC context whose stream Envoy already closed: every write fails."""

    async def write(self, resp: Any) -> None:
        raise RuntimeError('Failed "execute_batch"')


async def test_a_shutdown_cut_on_a_stream_already_gone_still_settles() -> None:
    """The shutdown cut's write fails (Envoy closed the stream meanwhile): the cut does not
    raise out of the drain, and the request is settled once on what was delivered."""
    lim = limiter()
    proc = await start(lim)
    await feed(proc, event(" a") + event(" b"))
    proc.writer = _GoneStream()
    assert await proc.cut_for_shutdown()
    await asyncio.gather(*proc.gw.background.pending)
    assert len(lim.settles) == 1
    assert proc.driver is not None and proc.driver.meter.delivered == 2


class _Context:
    """A gRPC context as the servicer sees it: ``read`` hands out the messages ``script`` yields
    (then EOF); ``write`` takes a few event-loop turns, as grpc.aio's does, and notes for each
    response whether a settlement had been started by then."""

    def __init__(self, script: Any, gw: Gateway, lim: RecordingLimiter) -> None:
        self.script, self.gw, self.lim = script, gw, lim
        self.writes: list[tuple[str, bool]] = []

    async def read(self) -> Any:
        return next(self.script, grpc.aio.EOF)

    async def write(self, resp: Any) -> None:
        settling = bool(self.gw.background.pending or self.lim.settles)  # started, or even done
        self.writes.append((resp.WhichOneof("response"), settling))
        for _ in range(3):
            await asyncio.sleep(0)

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False


async def test_a_cut_is_written_before_its_settlement_starts() -> None:
    """The servicer writes a cut's error event and its immediate response (the one that makes
    Envoy reset the upstream) before the request's settlement is started: nothing settlement
    does runs on the event loop between the two writes.  The request still settles once."""
    lim = limiter()
    cfg = load_config_text(RULES % ("strict", 100000))
    gw = Gateway(config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics())
    body = orjson.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )

    def script() -> Any:
        yield pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "x-request-id": "r-cut",
                }
            )
        )
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        yield pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "text/event-stream"})
        )
        # other requests took the hour's TPM but 4 tokens: the next lease grants 4, then none
        [tpm] = [b for b in lim.admits[0] if b.kind == "tpm"]
        lim.inner.seed_counter(tpm.key, tpm.limit - 4)
        chunk = b"".join(event(f" x{i}") for i in range(20))
        yield pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk))

    ctx = _Context(script(), gw, lim)
    await ExternalProcessorServicer(gw).Process(None, ctx)
    assert ctx.writes[-1][0] == "immediate_response"
    assert ctx.writes[-2][0] == "response_body"  # the error event
    assert not any(settling for _, settling in ctx.writes)  # none begun before any write
    await asyncio.gather(*gw.background.pending)
    assert len(lim.settles) == 1
