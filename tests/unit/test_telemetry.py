"""OpenTelemetry: the settings read from the standard variables, nothing imported or paid with
none set, and the span and metrics a request driven through the real processor (real ext_proc
protobufs, the in-memory limiter) produces, read back from the SDK's in-memory exporter and
reader: the parent taken from Envoy's gRPC metadata or the client's traceparent, the context
sent upstream, the attributes equal to the bill, a 429 and a cut naming their limit, and no
attribute holding a key's text."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.core.lifecycle import Closed
from extproc.core.rules import Limit
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from extproc.telemetry import NOOP, NOOP_TRACE, OtelConfigError, OtelSettings, from_env
from extproc.telemetry.attributes import limit_label
from extproc.telemetry.metrics import LocalMetrics
from extproc.telemetry.otel import OtelTelemetry, check_proto_modules
from extproc.telemetry.settings import CollectorAddress, collector_for_envoy
from tests.limiters import RecordingLimiter
from tests.unit.test_processor_flow import event, feed, forwarded, headers

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 50}
charging: {charge_every_tokens: 4, streaming: %s}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: %d}], failure_mode: %s}
tenants:
  t: {plan: p, keys: [{name: k1, plaintext: sk-secret-text-t}]}
"""
KEY = "sk-secret-text-t"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"
ENVOY_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ENVOY_PARENT = "00f067aa0ba902b7"


# -- settings ----------------------------------------------------------------------------------


def test_nothing_set_is_the_no_op() -> None:
    assert from_env({}) is NOOP
    assert NOOP.open(object()) is NOOP_TRACE
    assert NOOP_TRACE.start({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}) == ()
    off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}
    assert from_env(off) is NOOP


def test_no_endpoint_imports_nothing_of_opentelemetry() -> None:
    """With no endpoint the processor and the telemetry factory load no OpenTelemetry module
    of their own (redis-py loads its optional metrics support when the SDK is installed,
    before any of ours: that is redis's, and off unless an application turns it on)."""
    code = (
        "import sys, redis, redis.asyncio\n"
        "before = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "import extproc.app, extproc.server.servicer\n"
        "from extproc.telemetry import from_env\n"
        "assert from_env({}).enabled is False\n"
        "after = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "print(sorted(after - before), 'extproc.telemetry.otel' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[] False"


def test_settings_follow_the_standard_variables() -> None:
    s = OtelSettings.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
            "OTEL_SERVICE_NAME": "quota-eu",
            "OTEL_METRICS_EXPORTER": "none",
        }
    )
    assert (s.traces, s.metrics) == (True, False)
    assert (s.traces_protocol, s.metrics_protocol) == ("http/protobuf", "grpc")
    assert s.service_name == "quota-eu"
    only_traces = OtelSettings.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"})
    assert (only_traces.traces, only_traces.metrics) == (True, False)
    assert only_traces.service_name == "ai-quota"
    named = {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=1, service.name=eu"}
    assert OtelSettings.from_env(named).service_name == ""  # the SDK reads it from there
    with pytest.raises(OtelConfigError, match="grpc"):
        OtelSettings.from_env(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )
    with pytest.raises(OtelConfigError, match="otlp"):
        OtelSettings.from_env(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_TRACES_EXPORTER": "zipkin"}
        )


def test_collector_address_for_envoy() -> None:
    assert collector_for_envoy({}) is None
    a = collector_for_envoy({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4317"})
    assert a == CollectorAddress("otel-collector", 4317, False, "grpc")
    h = collector_for_envoy(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "https://tempo/otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
    )
    assert h == CollectorAddress("tempo", 4318, True, "http/protobuf", "/otlp/v1/traces")
    sig = collector_for_envoy(
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4318/t",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
    )
    assert sig is not None and sig.path == "/t"
    with pytest.raises(OtelConfigError):
        CollectorAddress.of("ftp://x", "grpc")


def test_limit_labels_name_the_rule() -> None:
    assert limit_label(Limit("tpm", 100, 60, "*", "tenant")) == "tpm/minute/tenant/*"
    assert limit_label(Limit("concurrency", 2, 0, "m", "key")) == "concurrency/key/m"
    assert limit_label(Limit("rpm", 5, 3600, "m", "key", shadow=True)) == "rpm/hour/key/m/shadow"


def test_the_otlp_modules_are_the_current_ones() -> None:
    """xds-protos ships an older copy of opentelemetry-proto's modules; setup reinstalls the
    real ones after it (a venv where it did not fails here, not in production)."""
    check_proto_modules()


# -- a request through the processor ------------------------------------------------------------


class Telemetry:
    """The real SDK with in-memory span export (every span sampled); the metrics as collected
    for the OTLP exporter."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(self.spans))
        self.local = LocalMetrics(Resource.create(), "test")
        self.otel = OtelTelemetry(tp, self.local)

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, Any]:
        """name -> (unit, [(attributes, data point)])."""
        data = self.local.collect()
        out: dict[str, Any] = {}
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out[m.name] = (
                        m.unit,
                        [(dict(p.attributes or {}), p) for p in m.data.data_points],
                    )
        return out


class _Call:
    """A gRPC context's invocation metadata, as Envoy sends it with its tracer on."""

    def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
        self.md = md

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.md


async def run(
    tel: Telemetry,
    *,
    streaming: str = "lazy",
    tpm: int = 100000,
    client_traceparent: str | None = None,
    call: Any = None,
    words: int = 6,
    seed_used: int | None = None,
    redis_down: bool = False,
    rules: str | None = None,
    user: str | None = None,
) -> tuple[RequestProcessor, list[Any], Any]:
    cfg = load_config_text(rules or RULES % (streaming, tpm, "open" if redis_down else "closed"))
    mem = MemoryLimiter(FakeClock())
    lim = RecordingLimiter(mem)
    lim.down = redis_down  # every call fails, as an unreachable Redis does
    gw = Gateway(config=cfg, limiter=lim, clock=mem.clock, metrics=Metrics(), telemetry=tel.otel)
    proc = RequestProcessor(gw, call)
    h = {":path": "/v1/chat/completions", ":method": "POST", "authorization": f"Bearer {KEY}"}
    if client_traceparent:
        h["traceparent"] = client_traceparent
    [first] = await proc.handle(pb.ProcessingRequest(request_headers=headers(h)))
    body = orjson.dumps(
        {
            "model": "m",
            "stream": True,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "hi"}],
        }
        | ({"user": user} if user else {})
    )
    [resp] = await proc.handle(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    got: list[Any] = []
    if resp.WhichOneof("response") == "immediate_response":
        proc.close(Closed.EOF)
        await asyncio.gather(*gw.background.pending)
        return proc, [resp], first
    if seed_used is not None:
        [b] = [b for b in proc.s.buckets if b.kind == "tpm"]
        mem.seed_counter(b.key, seed_used)
    await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "text/event-stream"})
        )
    )
    for i in range(words):
        got += await feed(proc, event(f" w{i}"))
        await asyncio.sleep(0)
    usage = {
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 8, "completion_tokens": words, "total_tokens": 8 + words},
    }
    got += await feed(proc, b"data: " + orjson.dumps(usage) + b"\n\n")
    got += await feed(proc, b"data: [DONE]\n\n", end=True)
    proc.close(Closed.EOF)
    await asyncio.gather(*gw.background.pending)
    return proc, got, first


def upstream_traceparent(first: Any) -> str:
    for h in first.request_headers.response.header_mutation.set_headers:
        if h.header.key == "traceparent":
            return str(h.header.raw_value.decode())
    raise AssertionError("no traceparent sent upstream")


def no_key_text(span: ReadableSpan) -> None:
    for k, v in (span.attributes or {}).items():
        assert KEY not in str(v), k
    for ev in span.events:
        for k, v in (ev.attributes or {}).items():
            assert KEY not in str(v), k


async def test_a_stream_is_one_span_under_the_clients_trace_with_the_bill() -> None:
    tel = Telemetry()
    proc, _, first = await run(tel, client_traceparent=f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01")
    [span] = tel.finished()
    ctx = span.get_span_context()
    assert ctx is not None and span.parent is not None
    assert f"{ctx.trace_id:032x}" == CLIENT_TRACE
    assert f"{span.parent.span_id:016x}" == CLIENT_PARENT
    # the engine gets the processor's span as its parent
    assert upstream_traceparent(first) == f"00-{CLIENT_TRACE}-{ctx.span_id:016x}-01"
    a = dict(span.attributes or {})
    assert span.name == "chat m"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "m"
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.max_tokens"] == 40
    assert a["ai_quota.decision"] == "admitted"
    assert a["ai_quota.ending"] == "completed"
    assert a["ai_quota.tenant.id"] == "t" and a["ai_quota.key.name"] == "k1"
    assert a["ai_quota.limits"] == ("rpm/hour/tenant/*", "tpm/hour/tenant/*")
    # the bill is what settlement decided: the upstream's figures within their bounds
    settled = proc.s.settled
    assert settled is not None
    assert a["gen_ai.usage.input_tokens"] == settled.input == 8
    assert a["gen_ai.usage.output_tokens"] == settled.output == 6
    assert a["ai_quota.settlement.billed_tokens"] == 14
    charged = a["ai_quota.settlement.charged_tokens"]
    assert isinstance(charged, int)
    assert a["ai_quota.settlement.refunded_tokens"] == charged - 14 > 0
    assert a["ai_quota.stream.charges"] == len(
        [e for e in span.events if e.name == "ai_quota.charge"]
    )
    names = [e.name for e in span.events]
    assert names.index("ai_quota.admitted") < names.index("ai_quota.first_chunk")
    assert "ai_quota.response_end" in names
    no_key_text(span)
    m = tel.metrics()
    unit, points = m["gen_ai.client.token.usage"]
    assert unit == "{token}"
    by_type = {p[0]["gen_ai.token.type"]: p[1].sum for p in points}
    assert by_type == {"input": 8, "output": 6}
    assert {p[0]["gen_ai.request.model"] for p in points} == {"m"}
    assert m["gen_ai.server.request.duration"][0] == "s"
    assert m["gen_ai.server.time_to_first_token"][0] == "s"
    assert m["gen_ai.server.time_per_output_token"][0] == "s"
    [(dec, point)] = m["ai_quota.decisions"][1]
    assert dec == {"ai_quota.decision": "admitted", "gen_ai.request.model": "m"}
    assert point.value == 1


async def test_envoys_grpc_metadata_is_the_parent_before_the_clients_header() -> None:
    tel = Telemetry()
    call = _Call((("traceparent", f"00-{ENVOY_TRACE}-{ENVOY_PARENT}-01"), ("x-other", "1")))
    await run(tel, call=call, client_traceparent=f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01")
    [span] = tel.finished()
    assert span.parent is not None and span.context is not None
    assert f"{span.context.trace_id:032x}" == ENVOY_TRACE
    assert f"{span.parent.span_id:016x}" == ENVOY_PARENT


async def test_no_traceparent_anywhere_starts_a_trace() -> None:
    tel = Telemetry()
    _, _, first = await run(tel)
    [span] = tel.finished()
    assert span.parent is None and span.context is not None
    assert upstream_traceparent(first).split("-")[1] == f"{span.context.trace_id:032x}"


async def test_a_refusal_names_the_limit_that_refused() -> None:
    tel = Telemetry()
    _, [resp], _ = await run(tel, tpm=5)  # its input alone (8 tokens) is over 5
    assert resp.immediate_response.status.code == 429
    [span] = tel.finished()
    a = dict(span.attributes or {})
    assert a["ai_quota.decision"] == "refused"
    assert a["error.type"] == "tpm_limit_exceeded"
    assert a["ai_quota.refused.limit.metric"] == "tpm"
    assert a["ai_quota.refused.limit.scope"] == "tenant"
    assert a["ai_quota.refused.limit.window"] == "hour"
    assert a["ai_quota.refused.limit.value"] == 5
    assert "gen_ai.usage.input_tokens" not in a  # nothing billed
    no_key_text(span)
    [(dec, _)] = tel.metrics()["ai_quota.decisions"][1]
    assert dec["ai_quota.decision"] == "refused"
    assert dec["ai_quota.limit.metric"] == "tpm" and dec["ai_quota.limit.scope"] == "tenant"


async def test_a_cut_carries_its_reason_and_limit() -> None:
    tel = Telemetry()
    # other requests took the hour's TPM but a few tokens: the strict lease runs out mid-stream
    proc, got, _ = await run(tel, streaming="strict", tpm=200, seed_used=196, words=20)
    data, _ = forwarded(got)
    assert b"event: error" in data
    [span] = tel.finished()
    a = dict(span.attributes or {})
    assert a["ai_quota.decision"] == "admitted"
    assert a["ai_quota.ending"] == "cut"
    assert a["ai_quota.cut.reason"] == "quota_exhausted"
    assert a["ai_quota.cut.limit.metric"] == "tpm"
    assert a["ai_quota.cut.limit.rule"] == "tpm/hour/tenant/*"
    delivered = a["ai_quota.cut.delivered_tokens"]
    assert proc.driver is not None and delivered == proc.driver.meter.delivered
    assert a["gen_ai.usage.output_tokens"] == delivered  # a cut bills what was delivered
    assert "ai_quota.cut" in [e.name for e in span.events]
    no_key_text(span)
    [(cut, point)] = tel.metrics()["ai_quota.stream.cuts"][1]
    assert cut["ai_quota.cut.reason"] == "quota_exhausted" and point.value == 1


# -- levels: the organisation and team, never the end user ------------------------------------

LEVEL_RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 50}
charging: {charge_every_tokens: 4}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: 100000}]}
organisations:
  o1: {limits: [{per: hour, tpm: 100000}]}
teams:
  g1:
    organisation: o1
    limits: [{per: hour, tpm: 100000}]
    end_users: {limits: [{per: hour, tpm: %d}]}
tenants:
  t: {plan: p, keys: [{name: k1, plaintext: sk-secret-text-t, team: g1}]}
"""
END_USER = "enduser-7f3a"  # the body's user: it must appear nowhere in the telemetry


def no_end_user(tel: Telemetry, span: ReadableSpan) -> None:
    """The end user's id is in no attribute of the span, of its events, or of any metric."""
    texts = [str(v) for v in (span.attributes or {}).values()]
    texts += [str(v) for ev in span.events for v in (ev.attributes or {}).values()]
    texts += [
        f"{k}={v}"
        for _, points in tel.metrics().values()
        for attrs, _ in points
        for k, v in attrs.items()
    ]
    assert texts and not [t for t in texts if END_USER in t]


async def test_a_span_names_the_levels_and_never_the_end_user() -> None:
    """A key of team g1 in organisation o1, the body naming an end user: the span carries
    ai_quota.organisation / ai_quota.team (configuration ids) and nothing names the end user,
    though a limit of the end user's own was charged."""
    tel = Telemetry()
    proc, _, _ = await run(tel, rules=LEVEL_RULES % 100000, user=END_USER)
    assert any(END_USER in b.key for b in proc.s.buckets)  # its own counter was charged
    [span] = tel.finished()
    a = dict(span.attributes or {})
    assert a["ai_quota.decision"] == "admitted" and a["ai_quota.ending"] == "completed"
    assert a["ai_quota.organisation"] == "o1"
    assert a["ai_quota.team"] == "g1"
    labels = a["ai_quota.limits"]
    assert isinstance(labels, tuple) and any("/user/" in str(x) for x in labels)
    no_end_user(tel, span)
    no_key_text(span)


async def test_a_refusal_by_the_end_users_limit_names_the_team_not_the_user() -> None:
    """Refused by the end user's own limit: the span's refused limit is of scope ``user`` and
    its owner the team; the end user's id is still nowhere (the 429's message names it, for
    the client who sent it)."""
    tel = Telemetry()
    _, [resp], _ = await run(tel, rules=LEVEL_RULES % 5, user=END_USER)
    assert resp.immediate_response.status.code == 429
    assert END_USER in resp.immediate_response.body.decode()
    [span] = tel.finished()
    a = dict(span.attributes or {})
    assert a["ai_quota.decision"] == "refused"
    assert a["ai_quota.refused.limit.scope"] == "user"
    assert a["ai_quota.refused.limit.owner"] == "g1"
    assert (a["ai_quota.organisation"], a["ai_quota.team"]) == ("o1", "g1")
    no_end_user(tel, span)


# -- Envoy's tracer ---------------------------------------------------------------------------


def test_envoy_config_renders_the_tracer_only_with_an_endpoint() -> None:
    from extproc.envoy_config import EnvoyPorts, render
    from extproc.envoy_tracing import OTEL_CLUSTER, EnvoyTracing

    assert EnvoyTracing.from_env({}) is None
    plain = render(EnvoyPorts())
    assert "tracing" not in str(plain)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4317",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }
    tracing = EnvoyTracing.from_env(env)
    assert tracing is not None and tracing.sampling_percent == 1.0
    boot = render(EnvoyPorts(tracing=tracing))
    [gateway] = boot["static_resources"]["listeners"]
    hcm = gateway["filter_chains"][0]["filters"][0]["typed_config"]
    provider = hcm["tracing"]["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    assert provider["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == OTEL_CLUSTER
    assert hcm["tracing"]["random_sampling"] == {"value": 1.0}
    [cluster] = [c for c in boot["static_resources"]["clusters"] if c["name"] == OTEL_CLUSTER]
    assert cluster["type"] == "STRICT_DNS"  # a host name
    ep = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert ep["address"]["socket_address"] == {"address": "otel-collector", "port_value": 4317}


async def test_the_docs_name_every_attribute_and_metric() -> None:
    """Each attribute a span or metric point carries (a stream, a refusal, a cut) and each
    metric is listed in docs/observability.md."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    keys: set[str] = set()
    metrics: set[str] = set()
    for kw in ({}, {"tpm": 5}, {"streaming": "strict", "tpm": 200, "seed_used": 196, "words": 20}):
        tel = Telemetry()
        await run(tel, **kw)
        for span in tel.finished():
            keys |= set(span.attributes or {})
            for ev in span.events:
                keys.add(ev.name)
                keys |= set(ev.attributes or {})
        for name, (_, points) in tel.metrics().items():
            metrics.add(name)
            for attrs, _ in points:
                keys |= set(attrs)

    def documented(key: str) -> bool:
        if f"`{key}`" in doc:
            return True
        prefix, _, last = key.rpartition(".")
        return f"`{prefix}.*`" in doc or (f"`{prefix}." in doc and f"`.{last}`" in doc)

    assert len(metrics) == 6
    missing = sorted(k for k in keys | metrics if not documented(k))
    assert not missing, missing


async def test_fail_open_is_a_decision_of_its_own() -> None:
    """Redis down and a plan that fails open: admitted unmetered, nothing billed."""
    tel = Telemetry()
    await run(tel, redis_down=True)
    [span] = tel.finished()
    a = dict(span.attributes or {})
    assert a["ai_quota.decision"] == "fail_open"
    assert "gen_ai.usage.input_tokens" not in a
    [(dec, _)] = tel.metrics()["ai_quota.decisions"][1]
    assert dec["ai_quota.decision"] == "fail_open"


async def test_an_unmetered_path_is_a_passthrough_span() -> None:
    tel = Telemetry()
    cfg = load_config_text(RULES % ("lazy", 1000, "closed"))
    mem = MemoryLimiter(FakeClock())
    gw = Gateway(config=cfg, limiter=mem, clock=mem.clock, metrics=Metrics(), telemetry=tel.otel)
    proc = RequestProcessor(gw)
    h = {":path": "/v1/models", ":method": "GET", "authorization": f"Bearer {KEY}"}
    [resp] = await proc.handle(pb.ProcessingRequest(request_headers=headers(h, eos=True)))
    assert resp.WhichOneof("response") == "request_headers"
    proc.close(Closed.EOF)
    await asyncio.gather(*gw.background.pending)
    [span] = tel.finished()
    assert span.name == "ai_quota passthrough"
    assert dict(span.attributes or {})["ai_quota.decision"] == "passthrough"
    no_key_text(span)


class _Exporter:
    """The OTLP exporter's interface, keeping what it is given."""

    def __init__(self) -> None:
        self.exports: list[Any] = []
        self.shut = False

    def export(self, data: Any, timeout_millis: float = 0) -> None:
        self.exports.append(data)

    def shutdown(self, timeout_millis: float = 0) -> None:
        self.shut = True


def test_local_metrics_export_on_their_interval_and_at_close() -> None:
    m = LocalMetrics(Resource.create(), "t")
    h = m.histogram("h", "s", "", (1.0, 2.0))
    c = m.counter("c", "{x}", "")
    exp = _Exporter()
    m.start(exp, interval_ms=20, timeout_ms=1000)
    h.record(0.5, (("a", "x"),))
    h.record(1.5, (("a", "x"),))
    h.record(9.0, (("a", "y"),))
    c.add(2, (("k", "v"),))
    deadline = time.monotonic() + 5
    while not exp.exports and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exp.exports, "no periodic export"
    m.close(1.0)
    assert exp.shut
    last = exp.exports[-1].resource_metrics[0].scope_metrics[0].metrics
    by_name = {x.name: x for x in last}
    points = {p.attributes["a"]: p for p in by_name["h"].data.data_points}
    assert points["x"].bucket_counts == [1, 1, 0] and points["x"].count == 2
    assert points["x"].sum == 2.0 and (points["x"].min, points["x"].max) == (0.5, 1.5)
    assert points["y"].bucket_counts == [0, 0, 1]
    assert [p.value for p in by_name["c"].data.data_points] == [2]
    assert by_name["c"].data.is_monotonic


def test_local_metrics_bound_their_attribute_sets() -> None:
    from extproc.telemetry.metrics import MAX_POINTS

    m = LocalMetrics(Resource.create(), "t")
    c = m.counter("c", "1", "")
    for i in range(MAX_POINTS + 10):
        c.add(1, (("i", i),))
    assert len(c.points) == MAX_POINTS + 1
    assert c.points[(("otel.metric.overflow", True),)] == 10
