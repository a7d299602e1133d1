"""The gateway's own answer: a gateway error, raised in any phase, mapped to the API's error
response (the one place it is), with its decision counted and logged."""

from __future__ import annotations

from typing import Any

import structlog

from extproc.core.apis.openai import CHAT
from extproc.core.envelope import Answered
from extproc.core.session import Session
from extproc.errors import GatewayError
from extproc.gateway import Gateway
from extproc.server import wire
from extproc.server.settle import access_metadata

log = structlog.get_logger("extproc")


def error_response(
    gw: Gateway, s: Session, trace: Any, err: GatewayError, latency_ms: float
) -> wire.ProcessingResponse:
    """The client's HTTP response for ``err`` (a 429 is a refusal, anything else an error)."""
    refused = err.status == 429
    trace.refused(err)
    decision = "refused" if refused else "error"
    gw.metrics.decisions.labels(decision, err.code).inc()
    log.info(
        "decision",
        request_id=s.request_id,
        tenant=s.tenant.id if s.tenant else None,
        model=s.model.name if s.model else None,
        decision=decision,
        status=err.status,
        code=err.code,
        message=err.message,
        latency_ms=latency_ms,
    )
    s.handle(Answered(refused))
    api = s.api or CHAT
    return wire.immediate(
        err.status,
        api.error_headers(err),
        api.error_body(err),
        f"ai_quota_{err.code}",
        access_metadata(s),
    )
