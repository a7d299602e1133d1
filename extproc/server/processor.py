"""One request's processor: the ext_proc phases mapped onto the sans-IO core and the limiter.

The servicer creates one :class:`RequestProcessor` per gRPC stream (one per HTTP request) and
calls one method per ProcessingRequest.  Errors from :mod:`extproc.errors` raised in any phase
become an immediate response in :meth:`RequestProcessor.handle` — the one place they are
mapped.  :meth:`RequestProcessor.finish` settles the request and runs whatever the ending.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from extproc.clock import Clock
from extproc.config.load import key_digest
from extproc.config.runtime import ApiKey, Charging, Model, RuntimeConfig, Tenant
from extproc.core import admission
from extproc.core.account import RequestAccount
from extproc.core.admission import Cost
from extproc.core.chunks import MalformedChunk, parse_event_data
from extproc.core.keys import WindowedBucket, ledger_key
from extproc.core.lifecycle import Input, Lifecycle, LifecycleError, State
from extproc.core.meter import Step, StreamMeter
from extproc.core.request import (
    ParsedRequest,
    effective_output_budget,
    endpoint_for_path,
    parse_request,
    rewrite_body,
)
from extproc.core.responses import error_body, error_headers, sse_error_event
from extproc.core.tokens import (
    PromptShapeError,
    PromptTooLarge,
    count_chat_request,
    count_completion_prompt,
)
from extproc.errors import (
    AuthenticationError,
    BadRequest,
    GatewayError,
    InternalError,
    LimiterUnavailable,
    PathNotAllowed,
    RequestTooLarge,
    UnknownModel,
)
from extproc.limiter.base import Limiter
from extproc.metrics import Metrics
from extproc.server import wire

log = structlog.get_logger("extproc")

# Prompts longer than this (characters) are counted in a worker thread: tiktoken releases
# the GIL, so a 32k-token prompt does not hold up other streams' chunks.
OFFLOAD_CHARS = 16_384
# Non-streaming JSON bodies read for their usage are buffered up to this size.
MAX_USAGE_BODY = 8 << 20

IDENTITY_HEADERS = ("x-quota-tenant", "x-quota-plan", "x-quota-key", "x-quota-input-tokens")


@dataclass
class Gateway:
    """What every processor shares: config (swappable on reload), limiter, clock, metrics."""

    config: RuntimeConfig
    limiter: Limiter
    clock: Clock
    metrics: Metrics
    key_prefix: str = "aiq"
    draining: bool = False
    pending: set[asyncio.Task[Any]] = field(default_factory=set)
    active: set[RequestProcessor] = field(default_factory=set)

    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _serial: itertools.count[int] = field(default_factory=itertools.count)

    def ledger_id(self, request_id: str) -> str:
        """A ledger id unique to one HTTP request: Envoy's request id, this process, a serial.

        A client that sends its own ``x-request-id`` twice makes two requests, charged twice;
        only this process's own retries of one call can meet the same ledger.
        """
        return f"{request_id}.{self.instance}.{next(self._serial)}"

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a background task alive until it ends (settlements are drained on shutdown)."""
        self.pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", error=repr(task.exception()))


class RequestProcessor:
    """The state of one HTTP request across its ext_proc messages."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.cfg = gw.config
        self.life = Lifecycle()
        self.started = time.perf_counter()
        self.request_id = ""
        self.path = ""
        self.key: ApiKey | None = None
        self.tenant: Tenant | None = None
        self.model: Model | None = None
        self.charging: Charging | None = None
        self.req: ParsedRequest | None = None
        self.cost: Cost | None = None
        self.buckets: list[WindowedBucket] = []
        self.headers_out: list[tuple[str, str]] = []
        self.account = RequestAccount()
        self.admitted = False
        self.status: int | None = None
        self.meter: StreamMeter | None = None
        self.json_body: bytearray | None = None
        self.usage_output: int | None = None
        self.ending = "unknown"
        self.settled = False
        self._charge_task: asyncio.Task[Any] | None = None
        self._charge_buckets: list[WindowedBucket] = []
        self._seq = 0
        self._ledger = ""
        self._raw_len = 0
        self._last_values: tuple[list[WindowedBucket], tuple[int, ...]] = ([], ())

    # -- dispatch --------------------------------------------------------------------------

    async def handle(self, req: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        """Answer one ProcessingRequest; client-facing errors become immediate responses."""
        which = req.WhichOneof("request")
        try:
            if which == "request_headers":
                return [await self.on_request_headers(req.request_headers)]
            if which == "request_body":
                return [await self.on_request_body(req.request_body)]
            if which == "response_headers":
                return [await self.on_response_headers(req.response_headers)]
            if which == "response_body":
                return await self.on_response_body(req.response_body)
            if which == "response_trailers":
                return self.on_response_trailers()
            if which == "request_trailers":
                return [wire.continue_request_trailers()]
            return []
        except GatewayError as err:
            return [self.reject(err)]
        except LifecycleError as exc:
            log.error("protocol_violation", request_id=self.request_id, error=str(exc))
            return [self.reject(InternalError("the gateway received messages out of order"))]

    def reject(self, err: GatewayError) -> wire.ProcessingResponse:
        """The single mapping from a gateway error to the client's HTTP response."""
        decision = "refused" if err.status == 429 else "error"
        self.gw.metrics.decisions.labels(decision, err.code).inc()
        log.info(
            "decision",
            request_id=self.request_id,
            tenant=self.tenant.id if self.tenant else None,
            model=self.model.name if self.model else None,
            input_tokens=self.cost.input_tokens if self.cost else None,
            decision=decision,
            status=err.status,
            code=err.code,
            message=err.message,
            latency_ms=round((time.perf_counter() - self.started) * 1000, 3),
        )
        if self.life.state in (State.AWAIT_BODY, State.AWAIT_HEADERS):
            self.life.state = State.DONE
        self.ending = "refused" if err.status == 429 else "rejected"
        resp = wire.immediate(
            err.status, error_headers(err), error_body(err), f"ai_quota_{err.code}"
        )
        resp.dynamic_metadata.CopyFrom(wire.dynamic_metadata(self._metadata(ending=self.ending)))
        return resp

    # -- request headers -------------------------------------------------------------------

    async def on_request_headers(self, hh: Any) -> wire.ProcessingResponse:
        """Identify the tenant from the API key; decide whether the path is metered."""
        self.life.advance(Input.REQUEST_HEADERS)
        h = wire.headers_of(hh)
        self.request_id = h.get("x-request-id", "") or f"gen-{id(self):x}-{time.time_ns()}"
        self.path = h.get(":path", "")
        structlog.contextvars.bind_contextvars(request_id=self.request_id)
        presented = _presented_key(h)
        if not presented:
            raise AuthenticationError(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        key = self.cfg.keys_by_digest.get(key_digest(presented))
        if key is None:
            raise AuthenticationError(f"Incorrect API key provided: {_mask(presented)}.")
        self.key = key
        self.tenant = self.cfg.tenants[key.tenant]
        identity = [
            ("x-quota-tenant", self.tenant.id),
            ("x-quota-plan", self.tenant.plan),
            ("x-quota-key", key.name),
        ]
        endpoint = endpoint_for_path(self.path)
        if endpoint is None or h.get(":method", "POST") != "POST":
            policy = self.cfg.other_paths
            if policy == "reject":
                raise PathNotAllowed(f"The gateway does not serve {self.path.split('?', 1)[0]}.")
            if policy == "rpm_only":
                await self._admit_rpm_only()
            self.life.advance(Input.PASS)
            return wire.continue_request_headers(
                identity, IDENTITY_HEADERS, mode=wire.passthrough_mode()
            )
        if hh.end_of_stream:
            raise BadRequest("the request has no body; expected a JSON object")
        return wire.continue_request_headers(identity, IDENTITY_HEADERS)

    async def _admit_rpm_only(self) -> None:
        assert self.tenant is not None and self.key is not None
        now = self.gw.clock.now_ms()
        limits = tuple(
            lim for lim in self.tenant.limits if lim.metric == "rpm" and lim.model == "*"
        )
        buckets = admission.buckets_for(
            prefix=self.gw.key_prefix,
            tenant=self.tenant.id,
            key_name=self.key.name,
            model="*",
            limits=limits,
            now_ms=now,
        )
        if not buckets:
            return
        cost = Cost(0, 0, 0, False, False, False, False, 1)
        res = await self._limit_admit(buckets, cost)
        if res is not None and not res.admitted and not res.duplicate:
            raise admission.refusal(
                buckets, res.values, cost, now, tenant=self.tenant.id, model="*"
            )

    # -- request body: admission -----------------------------------------------------------

    async def on_request_body(self, body: Any) -> wire.ProcessingResponse:
        """Parse, count input tokens, compute the cost and run the one admission script."""
        self.life.advance(Input.REQUEST_BODY)
        assert self.tenant is not None and self.key is not None
        if not body.end_of_stream:
            raise RequestTooLarge("the request body arrived in pieces; buffered mode is required")
        raw: bytes = body.body
        if len(raw) > self.cfg.max_body_bytes:
            raise RequestTooLarge(
                f"the request body is {len(raw)} bytes; the limit is {self.cfg.max_body_bytes}"
            )
        self._raw_len = len(raw)
        endpoint = endpoint_for_path(self.path)
        assert endpoint is not None
        req = parse_request(
            raw, endpoint, max_tokens_ceiling=self.cfg.max_tokens_ceiling, max_n=self.cfg.max_n
        )
        self.req = req
        model = self.cfg.resolve_model(req.model)
        if model is None:
            if self.cfg.unknown_model_action == "reject":
                raise UnknownModel(
                    f"The model '{req.model[:100]}' does not exist or you do not have access to it.",
                    status=self.cfg.unknown_model_status,
                )
            model = self.cfg.unknown_model
        self.model = model
        structlog.contextvars.bind_contextvars(tenant=self.tenant.id, model=model.name)
        input_tokens = await self._count_input(req, model)
        if model.max_input_tokens is not None and input_tokens > model.max_input_tokens:
            raise RequestTooLarge(
                f"The prompt has {input_tokens} tokens; model {model.name} accepts at most "
                f"{model.max_input_tokens}."
            )
        clamp: int | None = None
        if (
            req.declared_max_output is not None
            and req.declared_max_output > model.max_output_tokens
        ):
            if self.cfg.over_model_cap == "reject":
                raise BadRequest(
                    f"max_tokens is {req.declared_max_output}; model {model.name} generates at most "
                    f"{model.max_output_tokens} tokens.",
                    param="max_tokens",
                )
            clamp = model.max_output_tokens
        per_choice = effective_output_budget(req.declared_max_output, model.max_output_tokens)
        charging = self.cfg.charging_for(self.tenant.plan, model.name)
        self.charging = charging
        cost = admission.compute_cost(
            input_tokens=input_tokens,
            per_choice_max=per_choice,
            n=req.n,
            stream=req.stream,
            charging=charging,
        )
        self.cost = cost
        now = self.gw.clock.now_ms()
        self.buckets = self._buckets_at(now)
        self._ledger = ledger_key(
            self.gw.key_prefix, self.tenant.id, self.gw.ledger_id(self.request_id)
        )
        res = await self._limit_admit(self.buckets, cost)
        if res is None:  # fail-open: Redis is down and the policy lets traffic through
            self._admitted_unmetered()
        elif not res.admitted and not res.duplicate:
            raise admission.refusal(
                self.buckets, res.values, cost, now, tenant=self.tenant.id, model=model.name
            )
        else:
            # A duplicate can only be our own retried call (ledger ids are unique per HTTP
            # request): the first execution charged, so the request is admitted and metered.
            self.admitted = True
            self.account.record(self.buckets, cost.tpm_amount)
            hdrs = admission.rate_limit_headers(self.buckets, res.values, now)
            self.headers_out = hdrs.as_pairs()
        self.life.advance(Input.ADMITTED)
        self.gw.metrics.decisions.labels("admitted", "ok").inc()
        self.gw.metrics.admission_seconds.observe(time.perf_counter() - self.started)
        log.info(
            "decision",
            tenant=self.tenant.id,
            key=self.key.name,
            model=model.name,
            input_tokens=input_tokens,
            reserved_output=cost.reserved_output,
            stream=req.stream,
            decision="admitted" if res is not None else "admitted_unmetered",
            mode=charging.mode,
            streaming=charging.streaming,
            latency_ms=round((time.perf_counter() - self.started) * 1000, 3),
        )
        new_body = rewrite_body(
            req,
            clamp_to=clamp,
            force_include_usage=self.cfg.force_include_usage and cost.meter_stream,
            canonical_model=model.name if model.known else None,
        )
        return wire.continue_request_body(new_body)

    def _admitted_unmetered(self) -> None:
        self.admitted = False
        self.cost = None
        self.headers_out = []

    async def _count_input(self, req: ParsedRequest, model: Model) -> int:
        def count() -> int:
            if req.endpoint == "chat":
                return count_chat_request(req.body, model.counter, model.tokenizer)
            return count_completion_prompt(req.body, model.counter)

        try:
            if self._raw_len > OFFLOAD_CHARS:
                return await asyncio.to_thread(count)
            return count()
        except PromptTooLarge as exc:
            raise RequestTooLarge(str(exc)) from None
        except PromptShapeError as exc:
            raise BadRequest(str(exc)) from None

    async def _limit_admit(self, buckets: list[WindowedBucket], cost: Cost) -> Any:
        """Run admission; None means Redis failed and the policy is fail-open."""
        try:
            return await self.gw.limiter.admit(
                self._ledger
                or ledger_key(
                    self.gw.key_prefix,
                    self.tenant.id if self.tenant else "_",
                    self.gw.ledger_id(self.request_id),
                ),
                admission.admission_charges(buckets, cost),
                tpm_charged=cost.tpm_amount,
                count_refused=self.cfg.count_refused_requests,
                ledger_ttl_ms=self.cfg.ledger_ttl_seconds * 1000,
            )
        except LimiterUnavailable:
            self.gw.metrics.limiter_errors.labels("admit").inc()
            if self.cfg.failure_mode_for(self.tenant.plan if self.tenant else "") == "open":
                log.warning("limiter_unavailable_fail_open", request_id=self.request_id)
                return None
            raise

    # -- response headers ------------------------------------------------------------------

    async def on_response_headers(self, hh: Any) -> wire.ProcessingResponse:
        """Add x-ratelimit-*; switch SSE responses to full-duplex metering."""
        self.life.advance(Input.RESPONSE_HEADERS)
        h = wire.headers_of(hh)
        try:
            self.status = int(h.get(":status", "0"))
        except ValueError:
            self.status = 0
        if not self.admitted or self.cost is None:
            # Envoy's own local reply (413 before the body reached us, 503 ...) or unmetered.
            return wire.continue_response_headers(self.headers_out)
        ok = 200 <= self.status < 300
        meta = self._metadata(ending="in_progress")
        if not ok:
            self.ending = "upstream_error"
            await self.finish("upstream_error")
            return wire.continue_response_headers(self.headers_out, metadata=meta)
        is_sse = "text/event-stream" in h.get("content-type", "")
        if is_sse and self.cost.meter_stream:
            assert self.model is not None and self.req is not None
            self.meter = StreamMeter(
                count=self.model.stream_counter(),
                every=self.cost.every,
                strict=self.cost.strict,
                enforce=self.cost.enforce_stream,
                initial_lease=self.cost.reserved_output,
                strip_usage=self.cfg.force_include_usage and not self.req.client_include_usage,
            )
            self.life.advance(Input.STREAM_START)
            self.gw.metrics.active_streams.inc()
            return wire.continue_response_headers(
                self.headers_out, mode=wire.full_duplex_mode(), metadata=meta
            )
        if not is_sse and self.cost.settle_to_actual and not hh.end_of_stream:
            self.json_body = bytearray()
            return wire.continue_response_headers(
                self.headers_out, mode=wire.streamed_mode(), metadata=meta
            )
        return wire.continue_response_headers(self.headers_out, metadata=meta)

    # -- response body ---------------------------------------------------------------------

    async def on_response_body(self, body: Any) -> list[wire.ProcessingResponse]:
        """Meter SSE (full duplex: we forward) or collect a JSON body's usage (streamed)."""
        self.life.advance(Input.RESPONSE_BODY)
        if self.meter is not None:
            return await self._stream_body(body.body, body.end_of_stream)
        if self.json_body is not None:
            if len(self.json_body) < MAX_USAGE_BODY:
                self.json_body += body.body
            if body.end_of_stream:
                self._read_json_usage()
                await self.finish("completed")
            return [wire.continue_response_body()]
        return [wire.continue_response_body()]

    def _read_json_usage(self) -> None:
        assert self.json_body is not None
        try:
            chunk = parse_event_data(bytes(self.json_body).decode("utf-8", "replace"))
        except MalformedChunk:
            return
        if chunk.usage is not None:
            self.usage_output = chunk.usage.completion_tokens

    async def _stream_body(self, data: bytes, end: bool) -> list[wire.ProcessingResponse]:
        meter = self.meter
        assert meter is not None
        if meter.finished:
            return []
        out: list[wire.ProcessingResponse] = []
        task = self._charge_task
        if task is not None and task.done():
            # A charge answered since the last chunk: it may release held events, ask for the
            # next charge, or cut the stream. None of that may be dropped.
            answered = self._take_answer()
            if (
                answered.forward
                or answered.charge
                or answered.blocked
                or answered.cut_reason
                or answered.end_stream
            ):
                out += await self._apply(answered)
                if meter.finished:
                    return out
        step = meter.feed(data, end)
        if not (step.charge or step.blocked or step.cut_reason or step.end_stream):
            # The common case: forward what completed, no Redis, no await.
            if step.forward:
                out.append(wire.streamed_body(step.forward, False))
            return out
        out += await self._apply(step)
        if end and meter.finished and self.life.state is State.STREAMING:
            self.life.advance(Input.END)
            await self.finish("completed")
        return out

    async def _apply(self, step: Step) -> list[wire.ProcessingResponse]:
        """Forward what the meter released, start charges, wait when a strict lease ran dry."""
        meter = self.meter
        assert meter is not None
        out: list[wire.ProcessingResponse] = []
        while True:
            if step.cut_reason is not None:
                if step.forward:
                    out.append(wire.streamed_body(step.forward, False))
                out.append(self._cut())
                return out
            if step.forward or step.end_stream:
                meta = self._metadata(ending="completed") if step.end_stream else None
                out.append(wire.streamed_body(step.forward, step.end_stream, meta))
            if step.charge:
                self._start_charge(step.charge)
            if not step.blocked:
                return out
            # Held events wait for the pending charge (strict: the lease ran dry; lazy: Redis
            # fell 2N tokens behind). Its answer releases them, asks for more, or cuts.
            answered = await self._collect_charge(wait=True)
            if answered is None:  # nothing in flight: cannot happen, but never stall a stream
                log.error("blocked_without_charge", request_id=self.request_id)
                answered = meter.stop_enforcing()
            step = answered

    def _buckets_at(self, now_ms: int) -> list[WindowedBucket]:
        """This request's buckets in the windows containing ``now_ms``."""
        assert self.tenant is not None and self.key is not None and self.model is not None
        model_key = self.model.name if self.model.known else (self.req.model if self.req else "*")
        return admission.buckets_for(
            prefix=self.gw.key_prefix,
            tenant=self.tenant.id,
            key_name=self.key.name,
            model=model_key,
            limits=self.tenant.limits,
            now_ms=now_ms,
        )

    def _start_charge(self, amount: int) -> None:
        assert self.tenant is not None and self.key is not None and self.model is not None
        # TPM buckets only, in the order the limiter returns their values.
        self._charge_buckets = [
            b for b in self._buckets_at(self.gw.clock.now_ms()) if b.metric == "tpm"
        ]
        self._seq += 1
        charges = admission.tpm_charges(self._charge_buckets, amount)
        assert self.meter is not None
        self.gw.metrics.stream_charges.labels("strict" if self.meter.strict else "lazy").inc()
        self._charge_task = asyncio.ensure_future(
            self.gw.limiter.charge(
                self._ledger,
                self._seq,
                charges,
                amount,
                strict=self.meter.strict,
                ledger_ttl_ms=self.cfg.ledger_ttl_seconds * 1000,
            )
        )

    async def _collect_charge(self, *, wait: bool) -> Step | None:
        """Apply a finished (or, with ``wait``, the pending) charge's answer to the meter."""
        task = self._charge_task
        if task is None or (not wait and not task.done()):
            return None
        if not task.done():
            await asyncio.wait([task])
        return self._take_answer()

    def _take_answer(self) -> Step:
        """The meter's next step from the finished charge task's answer."""
        task = self._charge_task
        assert task is not None and task.done()
        self._charge_task = None
        meter = self.meter
        assert meter is not None
        try:
            res = task.result()
        except LimiterUnavailable:
            self.gw.metrics.limiter_errors.labels("charge").inc()
            meter.on_charge_failed()
            if self.cfg.failure_mode_for(self.tenant.plan if self.tenant else "") == "open":
                log.warning("limiter_unavailable_stream_unmetered", request_id=self.request_id)
                return meter.stop_enforcing()
            return meter.fail("quota backend unavailable")
        self.account.record(self._charge_buckets, res.granted)
        self._last_values = (self._charge_buckets, res.values)
        room = min(
            (b.limit.limit - v for b, v in zip(self._charge_buckets, res.values, strict=True)),
            default=None,
        )
        # Lazy and exhausted: the meter cuts before the next chunk goes out.
        return meter.on_charge(res.granted, res.exhausted, room)

    def _cut(self) -> wire.ProcessingResponse:
        meter = self.meter
        assert meter is not None and self.tenant is not None
        self.life.state = State.CUT
        reason = meter.cut_reason or "quota exhausted"
        if reason == "quota backend unavailable":
            event = sse_error_event(
                "The quota backend is unavailable; the stream was stopped.",
                error_type="server_error",
                code="quota_backend_unavailable",
            )
        elif reason == "upstream event too large":
            event = sse_error_event(
                "The upstream sent an SSE event larger than the gateway accepts; the stream was stopped.",
                error_type="server_error",
                code="upstream_event_too_large",
            )
        else:
            event = sse_error_event(
                self._cut_message(), error_type="tokens", code="tpm_limit_exceeded"
            )
        data = meter.cut(event)
        self.ending = "cut"
        log.info(
            "stream_cut",
            tenant=self.tenant.id,
            reason=reason,
            delivered_tokens=meter.delivered,
            charged=self.account.total,
        )
        return wire.streamed_body(data, True, self._metadata(ending="cut"))

    def _cut_message(self) -> str:
        assert self.tenant is not None
        now = self.gw.clock.now_ms()
        buckets, values = self._last_values
        tpm = [(b, v) for b, v in zip(buckets, values, strict=True) if b.metric == "tpm"]
        if not tpm:
            tpm = [(b, 0) for b in self.buckets if b.metric == "tpm"]
        if not tpm:
            return "Rate limit reached for tokens; the stream was stopped."
        b, v = max(tpm, key=lambda bv: bv[1] - bv[0].limit.limit)
        scope = admission.scope_label(b.limit)
        return (
            f"Rate limit reached for tokens per {admission.per_name(b.limit.window_s)} on tenant "
            f"{self.tenant.id} ({scope}): limit {b.limit.limit}, used {v if v else b.limit.limit}. "
            f"The stream was stopped after {self.meter.delivered if self.meter else 0} output tokens; "
            f"the limit resets in {b.reset_s(now):.0f}s."
        )

    def on_response_trailers(self) -> list[wire.ProcessingResponse]:
        """Trailers pass; a metered stream first flushes what it holds."""
        self.life.advance(Input.TRAILERS)
        out: list[wire.ProcessingResponse] = []
        if self.meter is not None and not self.meter.finished:
            step = self.meter.feed(b"", False)
            if step.forward:
                out.append(wire.streamed_body(step.forward, False))
        out.append(wire.continue_response_trailers())
        return out

    # -- settlement ------------------------------------------------------------------------

    def _metadata(self, *, ending: str) -> dict[str, object]:
        out: dict[str, object] = {
            "tenant": self.tenant.id if self.tenant else "",
            "model": self.model.name if self.model else "",
            "input_tokens": self.cost.input_tokens if self.cost else 0,
            "ending": ending,
        }
        if self.meter is not None:
            out["output_tokens"] = self.meter.delivered
        return out

    def final_output(self, ending: str) -> int | None:
        """Output tokens to charge for this ending; None keeps what was reserved."""
        if self.meter is not None:
            m = self.meter
            if ending == "completed" and m.usage is not None and m.cut_reason is None:
                return m.usage.completion_tokens
            return m.delivered
        if self.usage_output is not None:
            return self.usage_output
        return None

    async def finish(self, ending: str) -> None:
        """Settle exactly once: charge what was generated, refund what was reserved and unused."""
        if self.settled:
            return
        self.settled = True
        if self.ending == "unknown":  # a cut, refusal or upstream error already named it
            self.ending = ending
        if self.meter is not None:
            self.gw.metrics.active_streams.dec()
        if not self.admitted or self.cost is None or self.tenant is None:
            return
        if self._charge_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._collect_charge(wait=True)), 1.0)
            except Exception as exc:  # noqa: BLE001 - settlement must still run
                log.warning("pending_charge_lost", request_id=self.request_id, error=repr(exc))
        cost = self.cost
        ending = self.ending
        if self.status is not None and not 200 <= self.status < 300:
            final_total: int | None = 0
        elif not cost.settle_to_actual:
            final_total = None
        else:
            out = self.final_output(ending)
            final_total = None if out is None else cost.input_tokens + out
        self.gw.metrics.endings.labels(ending).inc()
        if final_total is None:
            self._log_settled(ending, self.account.total, 0)
            return
        current = self._buckets_at(self.gw.clock.now_ms())
        adjustments = self.account.adjustments(final_total, current)
        delta = final_total - self.account.total
        if adjustments:
            try:
                await self.gw.limiter.settle(
                    self._ledger, adjustments, ledger_ttl_ms=self.cfg.ledger_ttl_seconds * 1000
                )
            except LimiterUnavailable:
                self.gw.metrics.limiter_errors.labels("settle").inc()
                log.warning("settlement_failed", request_id=self.request_id, delta=delta)
                return
        self.gw.metrics.tokens.labels("net").inc(max(0, final_total))
        self._log_settled(ending, final_total, delta)

    def _log_settled(self, ending: str, total: int, delta: int) -> None:
        log.info(
            "settled",
            request_id=self.request_id,
            tenant=self.tenant.id if self.tenant else None,
            model=self.model.name if self.model else None,
            ending=ending,
            input_tokens=self.cost.input_tokens if self.cost else None,
            output_tokens=self.final_output(ending),
            charged_total=total,
            correction=delta,
            status=self.status,
        )


def _presented_key(h: dict[str, str]) -> str:
    auth = h.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return h.get("api-key", "").strip()


def _mask(key: str) -> str:
    if len(key) <= 8:
        return "*" * len(key)
    return f"{key[:3]}{'*' * 8}{key[-4:]}"
