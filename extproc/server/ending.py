"""The request's end, executed: a running stream cut at shutdown, and the background
settlement (the envelope's :class:`~extproc.core.envelope.SettlementStarts`, the stream's last
charge, then :mod:`extproc.server.settle`)."""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from extproc.core.envelope import SettlementStarts
from extproc.core.lifecycle import CutReason
from extproc.core.session import Session
from extproc.server.body import ResponseBody
from extproc.server.context import RequestContext
from extproc.server.counting import BoundCounting
from extproc.server.settle import settle
from extproc.server.stream import StreamDriver
from extproc.server.writelock import WriteLock

log = structlog.get_logger("extproc")


async def cut_stream(
    driver: StreamDriver, writer: Any, lock: WriteLock, counting: BoundCounting, request_id: str
) -> None:
    """Cut a running stream with ``server_shutdown``: its error event and end, written."""
    await counting.figures_ready()  # the cut's final figures
    async with lock:
        try:
            for resp in driver.cut(CutReason.SHUTDOWN):
                await writer.write(resp)
        except Exception as exc:  # Envoy or the client closed the stream meanwhile
            # the cut is decided (settlement bills what was delivered); only the message
            # could not reach a client that is gone
            log.info("shutdown_cut_not_delivered", request_id=request_id, error=repr(exc))


class Ended(Protocol):
    """What settlement reads of a request's processor."""

    ctx: RequestContext
    s: Session
    trace: Any
    counting: BoundCounting
    driver: StreamDriver | None
    body: ResponseBody | None
    first_chunk_ms: int


async def settle_request(p: Ended) -> None:
    """Settle the request (in the background, after its last response was sent); its span
    and metrics end with it."""
    p.trace.mark("response_end")
    try:
        await _settle(p)
    finally:
        p.trace.finish(p.s)  # the request's span and metrics, from its records
        p.counting.settled()


async def _settle(p: Ended) -> None:
    s, counting, driver, body = p.s, p.counting, p.driver, p.body
    counting.settling()
    await counting.figures_ready()
    s.handle(SettlementStarts())
    if driver is not None:
        # a charge not answered in time is counted once whether it ran (the settlement
        # takes it back) or not (a charge after the settlement charges nothing)
        await driver.settle_charge()
    end = driver.end() if driver is not None else body.end() if body is not None else None
    read_by_chunk = driver is not None or (body is not None and body.exact is not None)
    await settle(p.ctx, end, p.first_chunk_ms if read_by_chunk else 0)
