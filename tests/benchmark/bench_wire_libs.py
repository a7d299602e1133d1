"""Compare two Python bindings of the Envoy ext_proc v3 wire: ``xds-protos`` (generated ``_pb2``
modules on the upb protobuf runtime, what ``extproc/server/wire.py`` uses) and ``envoy-data-plane``
(betterproto2 dataclasses).

Cases, each timed with ``timeit`` (best of 5 repeats, reported in microseconds per operation):

* ``req_headers``: a ProcessingRequest with request_headers, 10 headers carried in ``raw_value``;
* ``resp_body_sse``: a ProcessingRequest with a 206-byte response_body (one SSE chunk);
* ``req_body_155k``: a ProcessingRequest with a 155 KB request_body (a large chat request);
* ``streamed_resp``: building and serializing a ProcessingResponse whose body mutation is a
  206-byte ``streamed_response`` (what the FULL_DUPLEX_STREAMED path sends per chunk).

For the requests, ``parse`` only decodes; ``parse+read`` also does what the servicer does with the
message (find the oneof, read every header's key and raw_value, or the body bytes). Both libraries
must produce byte-identical serializations for the same content; that is checked first.

Run as a script for the table (``python tests/benchmark/bench_wire_libs.py [--quick]``), or with
``pytest -m benchmark tests/benchmark/bench_wire_libs.py`` (correctness checks and one quick pass;
no assertion on speed). Results and the decision are in docs/wire-library.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = pytest.mark.benchmark

REPEATS = 5

HEADERS: list[tuple[str, str]] = [
    (":authority", "gateway.example.internal:10000"),
    (":path", "/v1/chat/completions"),
    (":method", "POST"),
    (":scheme", "http"),
    ("content-type", "application/json"),
    ("authorization", "Bearer sk-demo-standard-0123456789abcdef0123456789abcdef"),
    ("user-agent", "OpenAI/Python 1.52.0"),
    ("accept", "application/json"),
    ("x-request-id", "5f0c6a8e-3b1d-4c8e-9a3f-2d7b1e6c4a90"),
    ("x-forwarded-proto", "http"),
]


def _sse_chunk(size: int) -> bytes:
    """One ``data: {...}\\n\\n`` chat.completion.chunk event of exactly ``size`` bytes."""
    head = (
        'data: {"id":"chatcmpl-bench0001","object":"chat.completion.chunk","created":1718031200,'
        '"model":"sim-small","choices":[{"index":0,"delta":{"content":"'
    )
    tail = '"},"logprobs":null,"finish_reason":null}]}\n\n'
    pad = size - len(head) - len(tail)
    assert pad > 0
    return (head + ("word " * size)[:pad] + tail).encode()


def _chat_body(size: int) -> bytes:
    """A JSON chat request of exactly ``size`` bytes (one long user message)."""
    head = (
        '{"model":"sim-small","stream":true,"max_tokens":256,"messages":[{"role":"user","content":"'
    )
    tail = '"}]}'
    text = ("The quick brown fox jumps over the lazy dog. " * (size // 40 + 1))[
        : size - len(head) - len(tail)
    ]
    return (head + text + tail).encode()


SSE_CHUNK = _sse_chunk(206)
BIG_BODY = _chat_body(155 * 1024)


# ---------------------------------------------------------------------------------------------
# xds-protos (upb)
# ---------------------------------------------------------------------------------------------


class Upb:
    """The messages built with xds-protos' generated classes."""

    name = "xds-protos"

    def __init__(self) -> None:
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        self.pb = pb
        self.base = base_pb2

    def req_headers(self) -> Any:
        """ProcessingRequest{request_headers} with raw_value headers."""
        hm = self.base.HeaderMap(
            headers=[self.base.HeaderValue(key=k, raw_value=v.encode()) for k, v in HEADERS]
        )
        return self.pb.ProcessingRequest(request_headers=self.pb.HttpHeaders(headers=hm))

    def resp_body(self, data: bytes, eos: bool) -> Any:
        """ProcessingRequest{response_body}."""
        return self.pb.ProcessingRequest(
            response_body=self.pb.HttpBody(body=data, end_of_stream=eos)
        )

    def req_body(self, data: bytes) -> Any:
        """ProcessingRequest{request_body}, end_of_stream (BUFFERED mode)."""
        return self.pb.ProcessingRequest(
            request_body=self.pb.HttpBody(body=data, end_of_stream=True)
        )

    def streamed_response(self, data: bytes) -> bytes:
        """Build and serialize what wire.streamed_body() sends (same construction)."""
        common = self.pb.CommonResponse()
        common.body_mutation.streamed_response.body = data
        common.body_mutation.streamed_response.end_of_stream = False
        r = self.pb.ProcessingResponse(response_body=self.pb.BodyResponse(response=common))
        out: bytes = r.SerializeToString()
        return out

    def serialize(self, msg: Any) -> bytes:
        """Wire bytes of a message."""
        out: bytes = msg.SerializeToString()
        return out

    def parse(self, data: bytes) -> Any:
        """Decode a ProcessingRequest."""
        return self.pb.ProcessingRequest.FromString(data)

    def read_headers(self, data: bytes) -> dict[str, str]:
        """Decode, check the oneof, and read every header (as wire.headers_of does)."""
        req = self.pb.ProcessingRequest.FromString(data)
        assert req.WhichOneof("request") == "request_headers"
        return {
            h.key.lower(): h.raw_value.decode("utf-8", "replace")
            for h in req.request_headers.headers.headers
        }

    def read_body(self, data: bytes) -> int:
        """Decode, check the oneof, and take the body bytes."""
        req = self.pb.ProcessingRequest.FromString(data)
        which = req.WhichOneof("request")
        body = getattr(req, which)
        return len(body.body) + int(body.end_of_stream)


# ---------------------------------------------------------------------------------------------
# envoy-data-plane (betterproto2)
# ---------------------------------------------------------------------------------------------


class Bp2:
    """The same messages built with envoy-data-plane's betterproto2 dataclasses."""

    name = "envoy-data-plane"

    def __init__(self) -> None:
        import betterproto2
        from envoy_data_plane.envoy.config.core import v3 as core
        from envoy_data_plane.envoy.service.ext_proc import v3 as ep

        self.bp = betterproto2
        self.ep = ep
        self.core = core

    def req_headers(self) -> Any:
        """ProcessingRequest{request_headers} with raw_value headers."""
        hm = self.core.HeaderMap(
            headers=[self.core.HeaderValue(key=k, raw_value=v.encode()) for k, v in HEADERS]
        )
        return self.ep.ProcessingRequest(request_headers=self.ep.HttpHeaders(headers=hm))

    def resp_body(self, data: bytes, eos: bool) -> Any:
        """ProcessingRequest{response_body}."""
        return self.ep.ProcessingRequest(
            response_body=self.ep.HttpBody(body=data, end_of_stream=eos)
        )

    def req_body(self, data: bytes) -> Any:
        """ProcessingRequest{request_body}, end_of_stream (BUFFERED mode)."""
        return self.ep.ProcessingRequest(
            request_body=self.ep.HttpBody(body=data, end_of_stream=True)
        )

    def streamed_response(self, data: bytes) -> bytes:
        """Build and serialize the same streamed body mutation."""
        r = self.ep.ProcessingResponse(
            response_body=self.ep.BodyResponse(
                response=self.ep.CommonResponse(
                    body_mutation=self.ep.BodyMutation(
                        streamed_response=self.ep.StreamedBodyResponse(
                            body=data, end_of_stream=False
                        )
                    )
                )
            )
        )
        return bytes(r)

    def serialize(self, msg: Any) -> bytes:
        """Wire bytes of a message."""
        return bytes(msg)

    def parse(self, data: bytes) -> Any:
        """Decode a ProcessingRequest."""
        return self.ep.ProcessingRequest.parse(data)

    def read_headers(self, data: bytes) -> dict[str, str]:
        """Decode, check the oneof, and read every header."""
        req = self.ep.ProcessingRequest.parse(data)
        which, hh = self.bp.which_one_of(req, "request")
        assert which == "request_headers" and hh is not None
        return {h.key.lower(): h.raw_value.decode("utf-8", "replace") for h in hh.headers.headers}

    def read_body(self, data: bytes) -> int:
        """Decode, check the oneof, and take the body bytes."""
        req = self.ep.ProcessingRequest.parse(data)
        _, body = self.bp.which_one_of(req, "request")
        assert body is not None
        return len(body.body) + int(body.end_of_stream)


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One timed operation: microseconds per call for each library."""

    case: str
    op: str
    upb_us: float
    bp2_us: float

    @property
    def ratio(self) -> float:
        """How many times slower envoy-data-plane is than xds-protos."""
        return self.bp2_us / self.upb_us


def best_us(fn: Callable[[], object], repeats: int = REPEATS, min_time: float = 0.2) -> float:
    """Best of ``repeats`` timeit runs, each long enough (``min_time`` s), in µs per call."""
    timer = timeit.Timer(fn)
    number = 1
    while number < 1_000_000 and timer.timeit(number) < min_time:
        number *= 2
    return min(timer.repeat(repeat=repeats, number=number)) / number * 1e6


def wire_bytes(lib: Upb | Bp2) -> dict[str, bytes]:
    """The serialized form of every case, for the byte-identity check."""
    return {
        "req_headers": lib.serialize(lib.req_headers()),
        "resp_body_sse": lib.serialize(lib.resp_body(SSE_CHUNK, False)),
        "req_body_155k": lib.serialize(lib.req_body(BIG_BODY)),
        "streamed_resp": lib.streamed_response(SSE_CHUNK),
    }


def _ops(lib: Upb | Bp2) -> dict[tuple[str, str], Callable[[], object]]:
    """The timed callables for one library; messages and bytes are prepared outside the timing."""
    messages = {
        "req_headers": lib.req_headers(),
        "resp_body_sse": lib.resp_body(SSE_CHUNK, False),
        "req_body_155k": lib.req_body(BIG_BODY),
    }
    ops: dict[tuple[str, str], Callable[[], object]] = {}
    for case, msg in messages.items():
        data = lib.serialize(msg)
        read = lib.read_headers if case == "req_headers" else lib.read_body
        ops[case, "serialize"] = functools.partial(lib.serialize, msg)
        ops[case, "parse"] = functools.partial(lib.parse, data)
        ops[case, "parse+read"] = functools.partial(read, data)
    ops["streamed_resp", "build+serialize"] = functools.partial(lib.streamed_response, SSE_CHUNK)
    return ops


def measure(repeats: int = REPEATS, min_time: float = 0.2) -> list[Row]:
    """Time every case and operation for both libraries."""
    upb, bp2 = _ops(Upb()), _ops(Bp2())
    return [
        Row(
            case,
            op,
            best_us(upb[case, op], repeats, min_time),
            best_us(bp2[case, op], repeats, min_time),
        )
        for case, op in upb
    ]


IMPORTS = {
    "xds-protos": "from envoy.service.ext_proc.v3 import external_processor_pb2",
    "envoy-data-plane": "from envoy_data_plane.envoy.service.ext_proc import v3",
}


def import_ms(statement: str, runs: int = 5) -> float:
    """Best wall time (ms) of ``statement`` in a fresh interpreter (imports only, not start-up)."""
    code = (
        "import time; t = time.perf_counter(); "
        + statement
        + "; print((time.perf_counter() - t) * 1000)"
    )
    best = float("inf")
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        ).stdout
        best = min(best, float(out.strip()))
    return best


def runtime_note() -> str:
    """Interpreter, protobuf backend and library versions."""
    from importlib.metadata import version

    from google.protobuf.internal import api_implementation

    return (
        f"Python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
        f"protobuf {version('protobuf')} ({api_implementation.Type()}), "
        f"xds-protos {version('xds-protos')}, envoy-data-plane {version('envoy-data-plane')}, "
        f"betterproto2 {version('betterproto2')}"
    )


def table(rows: list[Row]) -> str:
    """A Markdown table of the rows."""
    lines = [
        "| case | operation | xds-protos µs | envoy-data-plane µs | ratio (edp / xds) |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r.case} | {r.op} | {r.upb_us:.2f} | {r.bp2_us:.2f} | {r.ratio:.1f}x |" for r in rows
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# pytest entry points (no assertion on speed)
# ---------------------------------------------------------------------------------------------


def test_fixture_sizes() -> None:
    """The SSE chunk is 206 bytes and the large request body 155 KB."""
    assert len(SSE_CHUNK) == 206
    assert len(BIG_BODY) == 155 * 1024


def test_both_libraries_serialize_byte_identically() -> None:
    """xds-protos and envoy-data-plane write the same bytes for the same content."""
    assert wire_bytes(Upb()) == wire_bytes(Bp2())


def test_each_library_reads_the_other_ones_bytes() -> None:
    """Bytes from one library parse in the other to the same headers and body."""
    upb, bp2 = Upb(), Bp2()
    for writer, reader in ((upb, bp2), (bp2, upb)):
        assert reader.read_headers(writer.serialize(writer.req_headers())) == dict(HEADERS)
        assert reader.read_body(writer.serialize(writer.req_body(BIG_BODY))) == len(BIG_BODY) + 1


def test_quick_measurement_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """One short pass over every case produces a positive timing for both libraries."""
    rows = measure(repeats=2, min_time=0.01)
    assert len(rows) == 10
    assert all(r.upb_us > 0 and r.bp2_us > 0 for r in rows)
    with capsys.disabled():
        print("\n" + table(rows))


def main(argv: list[str] | None = None) -> int:
    """Print the byte-identity check, the timing table and the import times."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    args = ap.parse_args(argv)
    print(runtime_note())
    same = wire_bytes(Upb()) == wire_bytes(Bp2())
    print(f"byte-identical serializations: {same}")
    rows = measure(repeats=2, min_time=0.01) if args.quick else measure()
    print(f"\nbest of {2 if args.quick else REPEATS} timeit repeats, µs per operation\n")
    print(table(rows))
    print("\nimport time in a fresh interpreter (best of 5):")
    for name, stmt in IMPORTS.items():
        print(f"  {name:17s} {import_ms(stmt):8.1f} ms   ({stmt})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
