"""A do-nothing ext_proc processor: the floor a grpc.aio processor can reach.

It exchanges exactly the messages the real gateway exchanges with Envoy and does no other
work: CONTINUE at request headers and body; at the headers of a 2xx response, the
``mode_override`` the real processor sends (``RequestProcessor.on_response_headers``):
FULL_DUPLEX_STREAMED with response trailers SEND for ``text/event-stream``, and response body
STREAMED for any other response with a body (the real one reads a JSON body's ``usage`` that
way when the plan settles to the actual usage, as the bench's plans do); no override for an
error status or a response without a body.  A full-duplex response body chunk is echoed
back unchanged with the same ``end_of_stream``; a STREAMED one gets a CONTINUE.  What it
leaves out is work, not messages: header mutations, dynamic metadata, and the admission and
settlement behind them.

The benchmark runs it in place of ``ai-quota serve`` to measure the per-request and per-chunk
cost of Python gRPC alone.  ``python -m extproc.bench.floor`` listens on ``AIQ_GRPC_ADDRESS``
(or ``--address``) and honours ``AIQ_EVENT_LOOP`` like the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

#: The gRPC service name Envoy's health check asks about (the real processor's too).
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

_Mode = processing_mode_pb2.ProcessingMode
_DUPLEX = _Mode(response_body_mode=_Mode.FULL_DUPLEX_STREAMED, response_trailer_mode=_Mode.SEND)
_STREAMED = _Mode(response_body_mode=_Mode.STREAMED)


def _header(headers: Any, name: str) -> bytes:
    for h in headers.headers.headers:
        if h.key.lower() == name:
            return bytes(h.raw_value)
    return b""


def response_mode(headers: Any) -> Any:
    """The ``mode_override`` for a response's headers message (None: keep the filter's)."""
    status = _header(headers, ":status")
    if not (status.isdigit() and 200 <= int(status) < 300):
        return None
    if b"text/event-stream" in _header(headers, "content-type"):
        return _DUPLEX
    if headers.end_of_stream:
        return None
    return _STREAMED


class FloorStream:
    """One request's exchange: answers each ProcessingRequest in order, no other work."""

    def __init__(self) -> None:
        #: the response body is FULL_DUPLEX_STREAMED (chunks are echoed back)
        self.duplex = False

    def answer(self, req: Any) -> Any:
        """The floor's reply to one ProcessingRequest (None: nothing to send)."""
        which = req.WhichOneof("request")
        if which == "response_body":
            if not self.duplex:
                return pb.ProcessingResponse(response_body=pb.BodyResponse())
            common = pb.CommonResponse()
            sr = common.body_mutation.streamed_response
            sr.body = req.response_body.body
            sr.end_of_stream = req.response_body.end_of_stream
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
        if which == "request_headers":
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        if which == "request_body":
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        if which == "response_headers":
            r = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            mode = response_mode(req.response_headers)
            if mode is not None:
                r.mode_override.CopyFrom(mode)
                self.duplex = mode is _DUPLEX
            return r
        if which == "response_trailers":
            return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        if which == "request_trailers":
            return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        return None


class FloorServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``ExternalProcessor.Process`` with the real servicer's read/write loop and no work."""

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        """Answer each message in order until Envoy closes or cancels the stream."""
        stream = FloorStream()
        while True:
            req = await context.read()
            if req is grpc.aio.EOF:
                return
            resp = stream.answer(req)
            if resp is not None:
                await context.write(resp)


async def serve(address: str, servicer: Any = None) -> int:
    """Serve ``servicer`` (the floor's by default) until SIGINT/SIGTERM."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer or FloorServicer(), server)
    # Envoy health-checks the ext_proc cluster (grpc.health.v1), as for the real processor.
    health = health_aio.HealthServicer()
    for name in ("", EXT_PROC_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m extproc.bench.floor``."""
    parser = argparse.ArgumentParser(prog="python -m extproc.bench.floor", description=__doc__)
    parser.add_argument("--address", default=os.environ.get("AIQ_GRPC_ADDRESS", "127.0.0.1:50051"))
    args = parser.parse_args(argv)
    if os.environ.get("AIQ_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    return asyncio.run(serve(args.address))


if __name__ == "__main__":
    raise SystemExit(main())
