"""The OpenTelemetry SDK behind :class:`~extproc.telemetry.base.Telemetry`: a tracer and a meter
exporting over OTLP (gRPC or HTTP), and the per-request trace the server feeds.

Imported only when an OTLP endpoint is configured (:func:`extproc.telemetry.from_env`).

The request's span starts when its request headers arrive (its start time is the ext_proc
stream's opening), with Envoy's context as its parent: the ext_proc call's gRPC metadata when
Envoy's tracer is on, else the client's ``traceparent`` header, else none (a new trace).  Its
own context goes upstream as a ``traceparent`` header, so the engine's spans nest under it (when
Envoy traces too, Envoy's router sets the header to its own span's context: the engine's spans
are then Envoy's children, in the same trace).  Everything else is set at :meth:`finish`, from
the session's records, in one go: a request that is not sampled costs a non-recording span and
its metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc.core.session import Session
from extproc.core.stream_vocabulary import Cut
from extproc.errors import GatewayError
from extproc.telemetry import attributes as attrs
from extproc.telemetry.base import RequestTrace, Telemetry
from extproc.telemetry.metrics import AttrKey, LocalMetrics
from extproc.telemetry.settings import OtelConfigError, OtelSettings

log = logging.getLogger("extproc.telemetry")

SCOPE = "ai-quota"

#: The advisory bucket boundaries of the GenAI semantic conventions' metrics.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)  # fmt: skip
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)  # fmt: skip
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_KEYS = ("traceparent", "tracestate")


class Instruments:
    """The metrics one process records (aggregated here: :mod:`extproc.telemetry.metrics`)."""

    def __init__(self, m: LocalMetrics) -> None:
        self.token_usage = m.histogram(
            "gen_ai.client.token.usage",
            "{token}",
            "Tokens billed per request, by gen_ai.token.type (input, output)",
            TOKEN_BUCKETS,
        )
        self.duration = m.histogram(
            "gen_ai.server.request.duration",
            "s",
            "From the ext_proc stream's opening to the response's end",
            DURATION_BUCKETS,
        )
        self.ttft = m.histogram(
            "gen_ai.server.time_to_first_token",
            "s",
            "From the request's arrival to the stream's first response chunk",
            TTFT_BUCKETS,
        )
        self.tpot = m.histogram(
            "gen_ai.server.time_per_output_token",
            "s",
            "A stream's time after its first chunk per further output token",
            TPOT_BUCKETS,
        )
        self.decisions = m.counter(
            "ai_quota.decisions",
            "{request}",
            "Requests by the gateway's decision (and the limit that refused)",
        )
        self.cuts = m.counter(
            "ai_quota.stream.cuts",
            "{stream}",
            "Streams the gateway cut, by reason (and the limit that ran out)",
        )


class OtelTelemetry(Telemetry):
    """Traces and metrics over OTLP."""

    enabled = True

    def __init__(
        self,
        tracer_provider: TracerProvider | None,
        metrics: LocalMetrics | None,
        *,
        shutdown: Sequence[Any] = (),
    ) -> None:
        self.tracer: Tracer | None = (
            tracer_provider.get_tracer(SCOPE) if tracer_provider is not None else None
        )
        self.metrics = metrics
        self.instruments = Instruments(metrics) if metrics is not None else None
        self._shutdown = list(shutdown)

    @classmethod
    def from_settings(cls, settings: OtelSettings) -> OtelTelemetry:
        """Providers with OTLP exporters; the SDK reads the rest of the standard variables
        (sampler, resource, export interval, headers, batch sizes)."""
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource

        check_proto_modules()
        # service.instance.id: the SDK's, one per process (the workers of `serve --workers N`
        # report apart); OTEL_RESOURCE_ATTRIBUTES are read by the SDK
        name = settings.service_name
        resource = Resource.create({SERVICE_NAME: name} if name else {})
        tracer_provider = None
        metrics = None
        if settings.traces:
            from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            tracer_provider = SdkTracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER
            tracer_provider.add_span_processor(
                BatchSpanProcessor(_span_exporter(settings.traces_protocol))
            )
        if settings.metrics:
            metrics = LocalMetrics(resource, SCOPE)
            metrics.start(
                _metric_exporter(settings.metrics_protocol),
                settings.metric_interval_ms,
                settings.metric_timeout_ms,
            )
        return cls(
            tracer_provider,
            metrics,
            shutdown=[tracer_provider] if tracer_provider is not None else [],
        )

    def open(self, call: Any = None) -> RequestTrace:
        carrier: dict[str, str] = {}
        if call is not None and self.tracer is not None:
            try:
                for key, value in call.invocation_metadata() or ():
                    if key in _TRACE_KEYS:
                        carrier[key] = value
            except Exception:  # a context without metadata (tests): no parent from it
                carrier = {}
        return OtelRequestTrace(self, carrier)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush the spans and metrics still buffered; stop the exporters."""
        if self.metrics is not None:
            try:
                self.metrics.close(timeout_s)
            except Exception:
                log.exception("telemetry_shutdown_failed")
            self.metrics = None
        for provider in self._shutdown:
            try:
                provider.force_flush(int(timeout_s * 1000))
                provider.shutdown()
            except Exception:
                log.exception("telemetry_shutdown_failed")
        self._shutdown = []


def _span_exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter()


def _metric_exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter()


class ProtoModulesBroken(OtelConfigError):
    """opentelemetry-proto's modules are an older copy (another package overwrote them)."""


def check_proto_modules() -> None:
    """The OTLP exporters need opentelemetry-proto's current modules; ``xds-protos`` (the
    Envoy API stubs) ships an old copy of the same files, and whichever package is installed
    last owns them.  ``scripts/setup`` and the image reinstall opentelemetry-proto after it;
    a process that finds the old copy says so instead of failing on an import deep inside."""
    try:
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
    except ImportError as exc:
        raise ProtoModulesBroken(
            "opentelemetry-proto's modules were overwritten by the older copy xds-protos ships; "
            "reinstall it: pip install --force-reinstall --no-deps opentelemetry-proto"
        ) from exc


class OtelRequestTrace(RequestTrace):
    """One request's span (started with the request headers) and what it saw."""

    __slots__ = ("_carrier", "_seen", "_span", "_tel")

    active = True

    def __init__(self, tel: OtelTelemetry, carrier: dict[str, str]) -> None:
        self._tel = tel
        self._carrier = carrier
        self._span: Span | None = None
        self._seen = attrs.Observed(marks={"open": time.time_ns()})

    def start(self, headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        tracer = self._tel.tracer
        if tracer is None or self._span is not None:
            return ()
        carrier = self._carrier
        if "traceparent" not in carrier:  # no context from Envoy: the client's, if any
            carrier = {k: headers[k] for k in _TRACE_KEYS if k in headers}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        span = tracer.start_span(
            "ai_quota",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._seen.marks["open"],
        )
        self._span = span
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return tuple(out.items())

    def mark(self, name: str) -> None:
        marks = self._seen.marks
        if name not in marks:  # the first time counts
            marks[name] = time.time_ns()

    def refused(self, err: GatewayError) -> None:
        self._seen.error = err

    def charge(self, seq: int, amount: int, *, strict: bool) -> None:
        seen = self._seen
        seen.charges += 1
        span = self._span
        if span is not None and span.is_recording():
            span.add_event(
                "ai_quota.charge",
                {"ai_quota.charge.seq": seq, "ai_quota.charge.tokens": amount, "strict": strict},
            )

    def charge_answered(self, granted: int | None, *, exhausted: bool = False) -> None:
        seen = self._seen
        if granted is None:
            seen.charge_failures += 1
        else:
            seen.charged_tokens += granted
        span = self._span
        if span is not None and span.is_recording():
            event: dict[str, Any] = {"ai_quota.charge.failed": granted is None}
            if granted is not None:
                event["ai_quota.charge.granted"] = granted
                event["ai_quota.charge.exhausted"] = exhausted
            span.add_event("ai_quota.charge.answered", event)

    def cut(self, action: Cut) -> None:
        seen = self._seen
        seen.cut_reason = action.reason.value
        seen.cut_delivered = action.delivered
        seen.cut_charged = action.charged
        seen.cut_error = action.error
        self.mark("cut")

    def finish(self, s: Session) -> None:
        try:
            self._finish(s)
        except Exception:  # telemetry never fails a request
            log.exception("telemetry_finish_failed")

    def _finish(self, s: Session) -> None:
        seen = self._seen
        now = time.time_ns()
        bill = attrs.bill(s)
        tel = self._tel
        ins = tel.instruments
        if ins is not None:
            _record_metrics(ins, s, seen, bill, now)
        span = self._span
        if span is None:
            return
        self._span = None
        if span.is_recording():
            span.update_name(attrs.span_name(s))
            span.set_attributes(attrs.span_attrs(s, seen, bill))
            for name in ("admitted", "first_chunk", "cut", "response_end"):
                at = seen.marks.get(name)
                if at is not None:
                    span.add_event(f"ai_quota.{name}", timestamp=at)
            if seen.error is not None and seen.error.status >= 500:
                span.set_status(Status(StatusCode.ERROR, seen.error.code))
            elif seen.cut_error is not None and seen.cut_error.status >= 500:
                span.set_status(Status(StatusCode.ERROR, seen.cut_error.code))
        span.end(end_time=now)


def _record_metrics(
    ins: Instruments, s: Session, seen: attrs.Observed, bill: attrs.Bill | None, now: int
) -> None:
    base: AttrKey = tuple(attrs.model_attrs(s).items())
    decision = attrs.decision(s, seen)
    dec: list[tuple[str, Any]] = [("ai_quota.decision", decision)]
    err = seen.error
    if err is not None:
        dec.append(("error.type", err.code))
        limit = getattr(err, "limit", None)
        if limit is not None:
            dec += [("ai_quota.limit.metric", limit.metric), ("ai_quota.limit.scope", limit.scope)]
    dec += [kv for kv in base if kv[0] == "gen_ai.request.model"]
    ins.decisions.add(1, tuple(dec))
    if seen.cut_reason:
        cut: list[tuple[str, Any]] = [("ai_quota.cut.reason", seen.cut_reason)]
        limit = seen.cut_error.limit if seen.cut_error is not None else None
        if limit is not None:
            cut += [("ai_quota.limit.metric", limit.metric), ("ai_quota.limit.scope", limit.scope)]
        ins.cuts.add(1, tuple(cut))
    if decision == "passthrough" or s.api is None:
        return
    marks = seen.marks
    t0 = marks["open"]
    end = marks.get("response_end", now)
    code = err.code if err is not None else (seen.cut_error.code if seen.cut_error else "")
    ins.duration.record((end - t0) / 1e9, (*base, ("error.type", code)) if code else base)
    if bill is not None:
        ins.token_usage.record(bill.input, (*base, ("gen_ai.token.type", "input")))
        ins.token_usage.record(bill.output, (*base, ("gen_ai.token.type", "output")))
    first = marks.get("first_chunk")
    parsed = s.parsed
    if first is None or parsed is None or not parsed.req.stream:
        return
    ins.ttft.record((first - t0) / 1e9, base)
    if bill is not None and bill.output > 1 and end > first:
        ins.tpot.record((end - first) / 1e9 / (bill.output - 1), base)
