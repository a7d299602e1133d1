"""OpenTelemetry through the real stack: Envoy with its OpenTelemetry tracer and the processor
both export to an OTLP receiver this test runs (:mod:`tests.otlp_receiver`, opentelemetry-proto's
service stubs), exactly as ``ai-quota envoy-config`` / ``scripts/run`` set them up from the
OTEL_* variables.  Read back as a tracing backend would: one request with a client
``traceparent`` is one trace holding Envoy's spans and the processor's (its child), the
processor's attributes equal the usage the client got, a 429 and a mid-stream cut carry their
decision, no attribute anywhere holds a key's text, and the metrics arrive with their names,
units and attributes."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from extproc.stack import Stack
from extproc.telemetry.otel import DURATION_BUCKETS, TOKEN_BUCKETS
from tests.e2e.conftest import client, make_stack
from tests.otlp_receiver import Receiver, Span

pytestmark = pytest.mark.e2e

MSG: list[Any] = [{"role": "user", "content": "Tell me a long story."}]
KEYS = ("sk-std", "sk-rpm", "sk-cut")
SERVICE = "ai-quota-e2e"


@pytest.fixture(scope="module")
def otlp() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, otlp: Receiver) -> Iterator[Stack]:
    """A stack whose processor and Envoy export to ``otlp`` (every request sampled)."""
    s = make_stack(
        Path(tmp_path_factory.mktemp("otel")),
        extproc_env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
    )
    yield s
    s.stop()


def traceparent() -> tuple[str, str, str]:
    """A client's sampled ``traceparent`` (trace id, its parent span id)."""
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def whole_trace(otlp: Receiver, trace_id: str) -> tuple[Span, list[Span]]:
    """The processor's span of the trace and Envoy's spans, once both have arrived (Envoy
    flushes its spans every few seconds)."""

    def ready(r: Receiver) -> tuple[Span, list[Span]] | None:
        spans = r.trace(trace_id)
        ours = [s for s in spans if s.service == SERVICE]
        envoy = [s for s in spans if s.service == "ai-quota-envoy"]
        ids = {s.span_id for s in envoy}
        if len(ours) == 1 and ours[0].parent_id in ids:
            return ours[0], envoy
        return None

    return otlp.wait(ready, timeout=20)


def no_key_text(spans: list[Span]) -> None:
    for s in spans:
        for k, v in s.attributes.items():
            assert not any(key in str(v) for key in KEYS), (s.name, k)
        for name, ev in s.events:
            for k, v in ev.items():
                assert not any(key in str(v) for key in KEYS), (s.name, name, k)


def test_one_request_is_one_trace_with_envoys_spans_and_the_bill(
    traced: Stack, otlp: Receiver
) -> None:
    tp, trace_id, parent = traceparent()
    rid = secrets.token_hex(8)
    c = client(traced, "sk-std")
    usage = None
    for ch in c.chat.completions.create(
        model="sim-small",
        messages=MSG,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": tp, "x-client-request-id": rid},
    ):
        if ch.usage is not None:
            usage = ch.usage
    assert usage is not None and usage.completion_tokens == 40
    ours, envoy = whole_trace(otlp, trace_id)
    # Envoy's request span is the client's child; the processor's span is the child of the
    # ext_proc stream's span Envoy opened for it
    by_id = {s.span_id: s for s in envoy}
    roots = [s for s in envoy if s.parent_id == parent]
    assert len(roots) == 1, [(s.name, s.parent_id) for s in envoy]
    ext = by_id[ours.parent_id]
    assert ext.parent_id == roots[0].span_id, (ext.name, roots[0].name)
    assert ours.name == "chat sim-small"
    a = ours.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "sim-small"
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert a["ai_quota.decision"] == "admitted" and a["ai_quota.ending"] == "completed"
    assert a["ai_quota.tenant.id"] == "t-std" and a["ai_quota.key.name"] == "std"
    assert a["http.response.status_code"] == 200
    assert a["ai_quota.settlement.billed_tokens"] == usage.prompt_tokens + 40
    names = [n for n, _ in ours.events]
    assert "ai_quota.admitted" in names and "ai_quota.first_chunk" in names
    # the processor's span lies within Envoy's request span (distinguishable timings)
    assert roots[0].start_ns <= ours.start_ns
    # the engine got the trace's context: its spans would be in the same trace
    recs = httpx.get(f"{traced.sim_url}/sim/requests").json()["requests"]
    [rec] = [r for r in recs if r["client_request_id"] == rid]
    assert rec["headers_seen"]["traceparent"].split("-")[1] == trace_id
    no_key_text([ours, *envoy])


def test_a_429_carries_the_limit_that_refused(traced: Stack, otlp: Receiver) -> None:
    c = client(traced, "sk-rpm")  # 2 requests per day
    for _ in range(2):
        c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=3)
    tp, trace_id, _ = traceparent()
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(
            model="sim-small", messages=MSG, max_tokens=3, extra_headers={"traceparent": tp}
        )
    ours, envoy = whole_trace(otlp, trace_id)
    a = ours.attributes
    assert a["ai_quota.decision"] == "refused"
    assert a["error.type"] == "rpm_limit_exceeded"
    assert a["ai_quota.refused.limit.metric"] == "rpm"
    assert a["ai_quota.refused.limit.scope"] == "tenant"
    assert a["ai_quota.refused.limit.window"] == "day"
    assert a["ai_quota.refused.limit.value"] == 2
    assert "gen_ai.usage.output_tokens" not in a
    no_key_text([ours, *envoy])


def test_a_mid_stream_cut_carries_its_reason_limit_and_delivered_tokens(
    traced: Stack, otlp: Receiver
) -> None:
    tp, trace_id, _ = traceparent()
    c = client(traced, "sk-cut")  # 300 tokens per day
    got = 0
    with pytest.raises(openai.APIError):
        for ch in c.chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=1000,
            stream=True,
            extra_headers={"traceparent": tp},
        ):
            if ch.choices and ch.choices[0].delta.content:
                got += 1
    ours, envoy = whole_trace(otlp, trace_id)
    a = ours.attributes
    assert a["ai_quota.ending"] == "cut"
    assert a["ai_quota.cut.reason"] == "quota_exhausted"
    assert a["ai_quota.cut.limit.metric"] == "tpm"
    assert a["ai_quota.cut.limit.rule"] == "tpm/day/tenant/*"
    assert a["ai_quota.cut.delivered_tokens"] == got  # the simulator sends a token per chunk
    assert a["gen_ai.usage.output_tokens"] == got  # a cut bills what was delivered
    assert a["ai_quota.stream.charges"] >= 1
    assert "ai_quota.cut" in [n for n, _ in ours.events]
    no_key_text([ours, *envoy])


def test_the_metrics_arrive_with_their_names_units_and_attributes(
    traced: Stack, otlp: Receiver
) -> None:
    # after the tests above (module order): a completed stream, a 429 and a cut were served
    c = client(traced, "sk-std")
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=7)

    def token_usage(r: Receiver) -> list[Any] | None:
        pts = [p for p in r.points if p.service == SERVICE]
        names = {p.name for p in pts}
        want = {
            "gen_ai.client.token.usage",
            "gen_ai.server.request.duration",
            "gen_ai.server.time_to_first_token",
            "gen_ai.server.time_per_output_token",
            "ai_quota.decisions",
            "ai_quota.stream.cuts",
        }
        return pts if want <= names else None

    pts = otlp.wait(token_usage, timeout=20)
    usage = [p for p in pts if p.name == "gen_ai.client.token.usage"]
    assert {p.unit for p in usage} == {"{token}"}
    assert {p.attributes["gen_ai.token.type"] for p in usage} == {"input", "output"}
    assert all(p.bounds == tuple(float(b) for b in TOKEN_BUCKETS) for p in usage)
    for p in usage:
        assert p.attributes["gen_ai.request.model"] == "sim-small"
        assert p.attributes["gen_ai.operation.name"] == "chat"
        assert set(p.attributes) <= {
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.request.model",
            "gen_ai.response.model",
            "gen_ai.token.type",
        }
    duration = [p for p in pts if p.name == "gen_ai.server.request.duration"]
    assert {p.unit for p in duration} == {"s"}
    assert all(p.bounds == DURATION_BUCKETS for p in duration)
    assert {p.unit for p in pts if p.name.startswith("gen_ai.server.time_")} == {"s"}
    decisions = {
        (p.attributes["ai_quota.decision"], p.attributes.get("ai_quota.limit.metric"))
        for p in pts
        if p.name == "ai_quota.decisions"
    }
    assert {("admitted", None), ("refused", "rpm")} <= decisions
    cuts = [p for p in pts if p.name == "ai_quota.stream.cuts"]
    assert {p.attributes["ai_quota.cut.reason"] for p in cuts} == {"quota_exhausted"}
    for p in pts:
        assert not any(k in str(v) for v in p.attributes.values() for k in KEYS)
