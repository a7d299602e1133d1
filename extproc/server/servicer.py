"""The ext_proc gRPC servicer: runs the stream loop, nothing else.

One gRPC stream per HTTP request.  Messages go to a :class:`RequestProcessor`; whatever ends
the stream (normal end, Envoy cancelling it, the client going away, shutdown), ``finally``
settles the request exactly once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.server.processor import Gateway, RequestProcessor

log = structlog.get_logger("extproc")


class ExternalProcessorServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``envoy.service.ext_proc.v3.ExternalProcessor``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: Any, context: Any
    ) -> None:
        """Answer each ProcessingRequest of one HTTP request in order.

        Written with ``context.read``/``context.write`` rather than as an async generator so
        that a cancelled stream raises ``CancelledError`` here and ``finally`` always runs.
        """
        proc = RequestProcessor(self.gw)
        self.gw.active.add(proc)
        structlog.contextvars.clear_contextvars()
        ending = "client_disconnected"
        try:
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    break
                resps = await proc.handle(req)
                if len(resps) == 1:
                    await context.write(resps[0])
                else:
                    for resp in resps:
                        await context.write(resp)
            ending = "upstream_reset"
        except asyncio.CancelledError:
            ending = "cancelled"
            raise
        except Exception:
            log.exception("stream_failed", request_id=proc.request_id)
            ending = "internal_error"
            raise
        finally:
            self.gw.active.discard(proc)
            if not proc.settled:
                # A separate task: the cancellation ending this stream must not stop settlement.
                final = "shutdown" if self.gw.draining else _ending_for(proc, ending)
                self.gw.track(asyncio.ensure_future(proc.finish(final)))


def _ending_for(proc: RequestProcessor, loop_ending: str) -> str:
    """Name the ending of a stream that closed before its response completed."""
    if proc.meter is not None or proc.json_body is not None:
        # The response was under way: the client left, or Envoy reset the upstream.
        return "client_disconnected" if loop_ending == "cancelled" else "upstream_reset"
    if proc.status is not None:
        return "completed"
    return "client_disconnected"
