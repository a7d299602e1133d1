"""Prometheus metrics, created on an injected registry (tests pass a fresh one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Every metric the gateway exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "aiq_decisions", "Admission decisions", ["decision", "code"], registry=r
        )
        self.tokens = Counter(
            "aiq_tokens_charged", "TPM tokens charged (net, after settlement)", ["kind"], registry=r
        )
        self.endings = Counter(
            "aiq_request_endings", "How admitted requests ended", ["ending"], registry=r
        )
        self.limiter_errors = Counter(
            "aiq_limiter_errors", "Redis calls that failed or timed out", ["op"], registry=r
        )
        self.stream_charges = Counter(
            "aiq_stream_charges", "Redis charges made while streams ran", ["mode"], registry=r
        )
        self.admission_seconds = Histogram(
            "aiq_admission_seconds",
            "Time from request body to decision",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.active_streams = Gauge("aiq_active_streams", "Streams being metered", registry=r)
