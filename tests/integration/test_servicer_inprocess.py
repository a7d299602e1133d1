"""The real ext_proc servicer on a grpc.aio server (port 0), driven message by message over a
real gRPC stream with ext_proc protobufs, the in-memory limiter (recorded, scriptable) and the
fake clock: every phase
policy (auth, paths, unknown model, clamp, fail-open, JSON usage, compression, content types,
every ending) without Envoy or Redis in the way."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.servicer import ExternalProcessorServicer
from tests.limiters import RecordingLimiter

pytestmark = pytest.mark.integration

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
charging: {charge_every_tokens: 4}
paths: {other: %s}
plans:
  p: {limits: [{model: "*", per: minute, rpm: 100, tpm: 100000}]}
  open: {limits: [{model: "*", per: minute, rpm: 100, tpm: 100000}], failure_mode: open}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
  o: {plan: open, keys: [{name: ko, plaintext: sk-open}]}
"""


class Served:
    """A servicer on a gRPC server: its gateway, limiter, clock and a client stub."""

    def __init__(self, gw: Gateway, lim: RecordingLimiter, clock: FakeClock, stub: Any) -> None:
        self.gw, self.lim, self.clock, self.stub = gw, lim, clock, stub

    async def settled(self) -> None:
        """Wait for the background settlements themselves (no polling)."""
        while self.gw.active:
            await asyncio.sleep(0.01)
        if self.gw.background.pending:
            await asyncio.gather(*list(self.gw.background.pending))


async def serve(other: str = "reject", rules: str | None = None) -> AsyncIterator[Served]:
    clock = FakeClock()
    lim = RecordingLimiter(MemoryLimiter(clock))
    gw = Gateway(
        config=load_config_text(rules or RULES % other),
        limiter=lim,
        clock=clock,
        metrics=Metrics(),
    )
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(gw, lim, clock, pb_grpc.ExternalProcessorStub(channel))
    finally:
        await channel.close()
        await server.stop(None)


@pytest.fixture
async def srv() -> AsyncIterator[Served]:
    async for s in serve():
        yield s


def hdrs(pairs: dict[str, str], *, eos: bool = False) -> Any:
    hh = pb.HttpHeaders(end_of_stream=eos)
    for k, v in pairs.items():
        hh.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return hh


def req_headers(path: str = "/v1/chat/completions", key: str = "sk-t", **extra: str) -> Any:
    h = {":path": path, ":method": "POST", "x-request-id": "rid"}
    if key:
        h["authorization"] = f"Bearer {key}"
    h.update(extra)
    return pb.ProcessingRequest(request_headers=hdrs(h))


def req_body(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    body.update(fields)
    return pb.ProcessingRequest(
        request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True)
    )


def resp_headers(status: int = 200, ctype: str = "application/json", **extra: str) -> Any:
    h = {":status": str(status)}
    if ctype:
        h["content-type"] = ctype
    h.update(extra)
    return pb.ProcessingRequest(response_headers=hdrs(h))


def resp_body(data: bytes, end: bool = False) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def chunk(text: str) -> bytes:
    obj = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}\n\n'
)


class Call:
    """One ext_proc stream: send a message, read its answers."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.Process()

    async def send(self, msg: Any, answers: int = 1) -> list[Any]:
        await self.call.write(msg)
        return [await self.call.read() for _ in range(answers)]

    async def close(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()


def immediate(resp: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
    ir = resp.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, orjson.loads(ir.body), headers


def set_headers(resp: Any, phase: str) -> dict[str, str]:
    m = getattr(resp, phase).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in m.set_headers}


def removed(resp: Any, phase: str) -> list[str]:
    return list(getattr(resp, phase).response.header_mutation.remove_headers)


def streamed(resps: list[Any]) -> bytes:
    return b"".join(r.response_body.response.body_mutation.streamed_response.body for r in resps)


def meta(resp: Any) -> dict[str, Any]:
    s = resp.dynamic_metadata.fields["ai_quota"].struct_value
    return {k: (v.string_value or v.number_value) for k, v in s.fields.items()}


# -- identity and paths -------------------------------------------------------------------


async def test_missing_and_unknown_keys_are_401(srv: Served) -> None:
    for key, needle in (("", "didn't provide"), ("sk-nope-123456", "Incorrect API key")):
        c = Call(srv.stub)
        [r] = await c.send(req_headers(key=key))
        status, body, _ = immediate(r)
        assert status == 401 and needle in body["error"]["message"]
        assert body["error"]["code"] == "invalid_api_key"


async def test_x_api_key_identifies_the_caller(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(req_headers(key="", **{"x-api-key": "sk-t"}))
    assert r.WhichOneof("response") == "request_headers"
    assert set_headers(r, "request_headers")["x-quota-tenant"] == "t"
    assert "accept-encoding" in removed(r, "request_headers")


async def test_unknown_path_is_a_json_404_by_default(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(req_headers(path="/generate"))
    status, body, headers = immediate(r)
    assert status == 404 and headers["content-type"] == "application/json"
    assert body["error"]["code"] == "unknown_url" and "/generate" in body["error"]["message"]
    assert not srv.lim.admits


async def test_allow_listed_path_passes_unmetered(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(req_headers(path="/v1/models/", **{":method": "GET"}))
    assert r.WhichOneof("response") == "request_headers"
    assert r.mode_override.response_header_mode == 2  # SKIP
    assert not srv.lim.admits


async def test_public_paths_pass_without_a_key_but_not_with_a_wrong_one(srv: Served) -> None:
    """GET /health and /v1/models need no identity (paths.public); a presented key must still
    be valid, a metered call still needs one, and a client's x-quota-* headers are removed."""
    for path in ("/health", "/v1/models", "/v1/models/m"):
        c = Call(srv.stub)
        [r] = await c.send(req_headers(path=path, key="", **{":method": "GET"}))
        assert r.WhichOneof("response") == "request_headers", path
        mutation = r.request_headers.response.header_mutation
        assert "x-quota-tenant" in mutation.remove_headers
        assert not mutation.set_headers
    for path, key, method in (
        ("/v1/models", "sk-wrong", "GET"),
        ("/v1/chat/completions", "", "POST"),
    ):
        c = Call(srv.stub)
        [r] = await c.send(req_headers(path=path, key=key, **{":method": method}))
        status, body, _ = immediate(r)
        assert status == 401, (path, body)
    assert not srv.lim.admits


async def test_an_empty_public_list_makes_allow_listed_paths_need_a_key() -> None:
    """paths.public: [] keeps /v1/models allowed and unmetered, for identified callers only."""
    rules = RULES.replace("paths: {other: %s}", "paths: {other: reject, public: []}")
    async for s in serve(rules=rules):
        [r] = await Call(s.stub).send(req_headers(path="/v1/models", key="", **{":method": "GET"}))
        status, _, _ = immediate(r)
        assert status == 401
        [r] = await Call(s.stub).send(req_headers(path="/v1/models", **{":method": "GET"}))
        assert r.WhichOneof("response") == "request_headers"


async def test_a_public_path_left_out_of_allow_is_not_public() -> None:
    """paths.allow: [] with the default public list: /v1/models follows paths.other (404
    with reject) for a caller with a key, and stays a 401 without one."""
    rules = RULES.replace("paths: {other: %s}", "paths: {other: reject, allow: []}")
    async for s in serve(rules=rules):
        [r] = await Call(s.stub).send(req_headers(path="/v1/models", key="", **{":method": "GET"}))
        assert immediate(r)[0] == 401
        [r] = await Call(s.stub).send(req_headers(path="/v1/models", **{":method": "GET"}))
        assert immediate(r)[0] == 404


async def test_rpm_only_counts_one_request() -> None:
    async for s in serve("rpm_only"):
        c = Call(s.stub)
        [r] = await c.send(req_headers(path="/generate"))
        assert r.WhichOneof("response") == "request_headers"
        assert [b.kind for b in s.lim.admits[0]] == ["rpm"]


async def test_compressed_request_body_is_a_clear_415(srv: Served) -> None:
    c = Call(srv.stub)
    [r] = await c.send(req_headers(**{"content-encoding": "gzip"}))
    status, body, _ = immediate(r)
    assert status == 415 and "without compression" in body["error"]["message"]


# -- admission ----------------------------------------------------------------------------


async def test_unknown_model_404(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    [r] = await c.send(req_body(model="gpt-nope"))
    status, body, _ = immediate(r)
    assert status == 404 and body["error"]["param"] == "model"


async def test_budget_clamped_and_written_as_int(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    [r] = await c.send(req_body(max_tokens=5000.0))
    forwarded = orjson.loads(r.request_body.response.body_mutation.body)
    assert forwarded["max_tokens"] == 1000 and isinstance(forwarded["max_tokens"], int)
    c2 = Call(srv.stub)
    await c2.send(req_headers())
    [r2] = await c2.send(req_body())
    assert orjson.loads(r2.request_body.response.body_mutation.body)["max_tokens"] == 1000


async def test_refusal_is_429_with_headers_and_one_rounding(srv: Served) -> None:
    srv.lim.refuse = True
    c = Call(srv.stub)
    await c.send(req_headers())
    [r] = await c.send(req_body())
    status, body, headers = immediate(r)
    assert status == 429
    assert f"Try again in {headers['retry-after']}s." in body["error"]["message"]
    assert meta(r)["ending"] == "refused"


async def test_deeply_nested_body_is_a_400(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    deep = (
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"n":'
        + b"[" * 1000
        + b"]" * 1000
        + b"}"
    )
    [r] = await c.send(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=deep, end_of_stream=True))
    )
    status, _, _ = immediate(r)
    assert status == 400


async def test_fail_open_plan_passes_when_redis_is_down(srv: Served) -> None:
    srv.lim.down = True
    c = Call(srv.stub)
    await c.send(req_headers(key="sk-open"))
    [r] = await c.send(req_body())
    assert r.WhichOneof("response") == "request_body"
    c2 = Call(srv.stub)
    await c2.send(req_headers())
    [r2] = await c2.send(req_body())
    assert immediate(r2)[0] == 503


# -- responses and endings ----------------------------------------------------------------


async def test_json_usage_settles_and_lands_in_metadata(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(max_tokens=50))
    [h] = await c.send(resp_headers())
    assert h.mode_override.response_body_mode == 1  # STREAMED: read the usage
    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}})
    [b] = await c.send(resp_body(body, end=True))
    assert meta(b)["ending"] == "completed" and meta(b)["output_tokens"] == 7
    await c.close()
    await srv.settled()
    [adj] = srv.lim.settles
    assert sum(a.amount for a in adj) == 7 - 50  # reserved 50, generated 7


async def test_usage_above_what_could_be_generated_is_capped(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(max_tokens=50))
    await c.send(resp_headers())
    body = orjson.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 10**9}})
    [b] = await c.send(resp_body(body, end=True))
    assert meta(b)["output_tokens"] == 50
    await c.close()
    await srv.settled()
    assert srv.lim.settles == [] or sum(a.amount for a in srv.lim.settles[0]) == 0


async def test_gzipped_stream_is_decoded_metered_and_headers_fixed(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(stream=True))
    [h] = await c.send(
        resp_headers(
            200,
            "Text/Event-Stream; charset=utf-8",
            **{"content-encoding": "gzip", "content-length": "99"},
        )
    )
    assert h.mode_override.response_body_mode == 4  # FULL_DUPLEX_STREAMED
    assert {"content-length", "content-encoding"} <= set(removed(h, "response_headers"))
    plain = b"".join(chunk(f" w{i}") for i in range(20)) + USAGE + b"data: [DONE]\n\n"
    out = await c.send(resp_body(gzip.compress(plain), end=True), answers=2)
    data = streamed(out)
    assert b" w19" in data and data.endswith(b"data: [DONE]\n\n")
    assert b"usage" not in data  # the client did not ask for it
    await c.close()
    await srv.settled()
    assert sum(srv.lim.charges) + sum(a.amount for s in srv.lim.settles for a in s) > 0


async def test_ndjson_stream_is_refused_fail_closed(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(stream=True))
    [r] = await c.send(resp_headers(ctype="application/x-ndjson"))
    status, body, _ = immediate(r)
    assert status == 502 and body["error"]["code"] == "unmeterable_response"


async def test_upstream_error_refunds_everything(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(max_tokens=20))
    [h] = await c.send(resp_headers(status=500))
    assert meta(h)["ending"] == "upstream_error"
    await c.close()
    await srv.settled()
    [adj] = srv.lim.settles
    admitted = srv.lim.admits[0][1].amount
    assert sum(a.amount for a in adj) == -admitted


async def test_client_gone_before_response_is_charged_by_the_abandon_rule(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(max_tokens=1000))
    srv.clock.advance(1.0)
    c.cancel()
    await srv.settled()
    [adj] = srv.lim.settles
    # input stays, 1 s at 200 tokens/s of the 1000 reserved stays: 800 refunded
    assert sum(a.amount for a in adj) == -800


async def test_stream_cancelled_mid_way_settles_delivered(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    await c.send(req_body(stream=True, max_tokens=100))
    await c.send(resp_headers(ctype="text/event-stream"))
    await c.send(resp_body(chunk(" a") + chunk(" b")), answers=1)
    c.cancel()
    await srv.settled()
    charged = sum(srv.lim.charges) + sum(a.amount for s in srv.lim.settles for a in s)
    input_tokens = srv.lim.admits[0][1].amount
    assert charged == 2  # output " a" " b" on top of the input
    assert input_tokens > 0


async def test_request_body_before_trailers_is_admitted(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    [r] = await c.send(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=False))
    )
    assert r.WhichOneof("response") == "request_body"


async def test_envoy_local_reply_passes_unchanged(srv: Served) -> None:
    c = Call(srv.stub)
    await c.send(req_headers())
    [r] = await c.send(resp_headers(status=413, ctype="text/plain"))
    assert r.WhichOneof("response") == "response_headers"


async def test_envoy_reply_without_request_headers_passes(srv: Served) -> None:
    """Envoy answered a request it rejected itself (e.g. %2F in the path): its reply passes."""
    c = Call(srv.stub)
    [r] = await c.send(resp_headers(status=400, ctype="text/plain"))
    assert r.WhichOneof("response") == "response_headers"
    [b] = await c.send(resp_body(b"Bad Request", end=True))
    assert b.WhichOneof("response") == "response_body"


async def test_counting_queue_past_its_deadline_is_a_json_503() -> None:
    """Large prompts wait for a counting thread; past requests.count_deadline_ms the client
    gets the gateway's JSON 503 (never Envoy's empty 504)."""
    rules = (RULES % "reject").replace(
        "paths: {other: reject}", "paths: {other: reject}\nrequests: {count_deadline_ms: 100}"
    )
    async for s in serve(rules=rules):
        for _ in range(2):  # every counting slot busy
            await s.gw.count_slots.acquire()
        c = Call(s.stub)
        await c.send(req_headers())
        [r] = await c.send(req_body(messages=[{"role": "user", "content": "word " * 20_000}]))
        status, body, headers = immediate(r)
        assert status == 503 and body["error"]["code"] == "gateway_busy"
        assert headers["retry-after"] == "1"


async def test_unseen_server_side_input_is_charged_from_the_upstreams_figure(srv: Served) -> None:
    """A Responses request continuing a stored conversation: the gateway cannot count the
    earlier turns, so settlement charges the upstream's input figure (it can only add)."""
    c = Call(srv.stub)
    await c.send(req_headers(path="/v1/responses"))
    body: dict[str, Any] = {"model": "m", "input": "and then?", "previous_response_id": "resp_1"}
    body["max_output_tokens"] = 20
    [r] = await c.send(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True))
    )
    assert r.WhichOneof("response") == "request_body"
    await c.send(resp_headers())
    usage = {"input_tokens": 500, "output_tokens": 7, "total_tokens": 507}
    await c.send(resp_body(orjson.dumps({"object": "response", "usage": usage}), end=True))
    await c.close()
    await srv.settled()
    admitted = srv.lim.admits[0][1].amount
    [adj] = srv.lim.settles
    assert admitted + sum(a.amount for a in adj) == 507
