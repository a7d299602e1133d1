"""The request's headers, executed: the caller identified (:mod:`extproc.server.identity`), the
path's handling decided by the core (:mod:`extproc.core.routing`), the session told
(:mod:`extproc.core.envelope`), and Envoy's answer built."""

from __future__ import annotations

import time
from typing import Any

import structlog

from extproc.core.apis.registry import api_for_path
from extproc.core.envelope import CallerIdentified, PassThrough, RequestHeaders
from extproc.core.keys import ledger_key
from extproc.core.phase_records import Identified, Requested
from extproc.core.routing import public_path, route
from extproc.core.waiting import PRIORITY_HEADER
from extproc.errors import AuthenticationError, BadRequest
from extproc.errors import UnsupportedEncoding as UnsupportedRequestEncoding
from extproc.server import wire
from extproc.server.admit import admit_rpm_only
from extproc.server.context import RequestContext
from extproc.server.identity import IDENTITY_HEADERS, end_user_hint, identify, presented_key


async def on_request_headers(
    ctx: RequestContext, trace: Any, req: Any, *, own_id: str
) -> wire.ProcessingResponse:
    """Identify the caller; decide how the path is handled (``req``: the request's headers and
    Envoy's metadata; ``own_id`` names the request when Envoy gave it no ``x-request-id``)."""
    gw, cfg, s = ctx.gw, ctx.cfg, ctx.s
    hh = req.request_headers
    h = wire.headers_of(hh)
    request_id = h.get("x-request-id", "") or f"gen-{own_id}-{time.time_ns()}"
    path = h.get(":path", "")
    found = api_for_path(path)
    # errors speak the API's own shape, even the caller's identification errors
    s.handle(RequestHeaders(Requested(request_id, path, gw.bind(found) if found else None)))
    up = trace.start(h)  # the traceparent to send upstream (none with tracing off)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    meta = (
        wire.metadata_of(req)
        if cfg.identity.sources != ["api_key"] or "jwt" in cfg.end_users.sources
        else None
    )
    method = h.get(":method", "POST")
    try:
        caller = identify(cfg, h, meta)
    except AuthenticationError:
        # a public path (a probe, a model listing) needs no identity; a key that is
        # presented must still be valid
        public = public_path(path, method, allowed=cfg.allowed_paths, public=cfg.public_paths)
        if presented_key(h) or not public:
            raise
        s.handle(PassThrough())
        return wire.continue_request_headers(up, IDENTITY_HEADERS, mode=wire.passthrough_mode())
    kind, api = route(path, method, allowed=cfg.allowed_paths, other=cfg.other_paths)
    metered_api = gw.bind(api) if api else None
    ledger = ledger_key(gw.key_prefix, caller.tenant.slot, gw.ledger_id(request_id))
    end_user, body_first = end_user_hint(cfg, h, meta)
    identified = Identified(
        request_id,
        path,
        metered_api if kind == "metered" else s.api,
        caller.key,
        caller.tenant,
        ledger,
        end_user=end_user,
        end_user_body=body_first,
        priority=h.get(PRIORITY_HEADER),
    )
    s.handle(CallerIdentified(identified))
    if kind != "metered":
        if kind == "rpm_only":
            await admit_rpm_only(ctx)
        s.handle(PassThrough())
        return wire.continue_request_headers(
            [*caller.headers(), *up], IDENTITY_HEADERS, mode=wire.passthrough_mode()
        )
    encoding = h.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedRequestEncoding(
            f"The request body is sent with Content-Encoding '{encoding[:40]}'; the gateway "
            "reads uncompressed JSON only. Send the body without compression."
        )
    if hh.end_of_stream:
        raise BadRequest("the request has no body; expected a JSON object")
    # The upstream answers in identity encoding: the gateway must read what it meters.
    return wire.continue_request_headers(
        [*caller.headers(), *up], (*IDENTITY_HEADERS, "accept-encoding")
    )
