"""The ext_proc gRPC servicer: runs the stream loop, nothing else.

One gRPC stream per HTTP request.  Messages go to a :class:`RequestProcessor`; however the
stream ends (Envoy half-closing it, Envoy cancelling it, an error, shutdown), ``finally`` tells
the processor how, and the processor's lifecycle names the ending and settles once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.core.lifecycle import Closed
from extproc.gateway import Gateway
from extproc.server.processor import RequestProcessor

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
        proc = RequestProcessor(self.gw, context)  # context: Envoy's trace context, if any
        proc.writer = context
        self.gw.active.add(proc)
        structlog.contextvars.clear_contextvars()
        how = Closed.CANCELLED
        lock = proc.write_lock
        try:
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    break
                resps = await proc.handle(req)
                if not lock.try_acquire():  # a shutdown cut is writing: wait for it
                    await lock.acquire()
                try:
                    for resp in resps:
                        await context.write(resp)
                finally:
                    lock.release()
                proc.sent()  # a settlement these responses ended with starts now, not between them
            how = Closed.EOF
        except asyncio.CancelledError:
            raise
        except Exception:
            if _peer_gone(context):
                how = Closed.CANCELLED  # a write after Envoy reset the stream: not our error
            else:
                log.exception("stream_failed", request_id=proc.request_id)
                how = Closed.ERROR
                raise
        finally:
            self.gw.active.discard(proc)
            if self.gw.draining and how is not Closed.EOF:
                how = Closed.SHUTDOWN
            proc.close(how)


def _peer_gone(context: Any) -> bool:
    try:
        return bool(context.cancelled() or context.done())
    except Exception:  # older grpcio without done()
        return False
