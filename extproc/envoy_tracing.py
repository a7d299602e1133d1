"""Envoy's OpenTelemetry tracer in the rendered bootstrap (docs/observability.md): the
connection manager's tracer and the collector's cluster, from the processors' OTEL_*
variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.telemetry.settings import ENVOY_SERVICE_NAME, CollectorAddress, collector_for_envoy


@dataclass(frozen=True)
class EnvoyTracing:
    """Envoy's OpenTelemetry tracer (``envoy.tracers.opentelemetry``): its spans go to
    ``collector`` (OTLP over gRPC or HTTP); ``sampling_percent`` of the requests that come
    without a sampling decision are traced (a client's sampled ``traceparent`` is followed)."""

    collector: CollectorAddress
    service_name: str = ENVOY_SERVICE_NAME
    sampling_percent: float = 100.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EnvoyTracing | None:
        """The tracer the OTEL_* variables describe (the processors' traces endpoint and, for
        a ``traceidratio`` sampler, its ratio), or None when no traces are exported."""
        collector = collector_for_envoy(env)
        if collector is None:
            return None
        percent = 100.0
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
        if sampler in ("traceidratio", "parentbased_traceidratio"):
            try:
                percent = min(100.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "1")) * 100))
            except ValueError:
                percent = 100.0
        elif sampler in ("always_off", "parentbased_always_off"):
            percent = 0.0
        return cls(collector, sampling_percent=percent)


#: The cluster Envoy's tracer sends its spans to.
OTEL_CLUSTER = "opentelemetry_collector"


def tracing_config(t: EnvoyTracing) -> dict[str, Any]:
    """The connection manager's OpenTelemetry tracer (docs/observability.md).  The ext_proc
    filter's gRPC stream is a child span of the request's, and its context travels in the
    stream's metadata: the processors' spans are its children."""
    c = t.collector
    provider: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
        "service_name": t.service_name,
    }
    if c.protocol == "grpc":
        provider["grpc_service"] = {"envoy_grpc": {"cluster_name": OTEL_CLUSTER}, "timeout": "1s"}
    else:
        scheme = "https" if c.tls else "http"
        provider["http_service"] = {
            "http_uri": {
                "uri": f"{scheme}://{c.host}:{c.port}{c.path}",
                "cluster": OTEL_CLUSTER,
                "timeout": "1s",
            }
        }
    return {
        "provider": {"name": "envoy.tracers.opentelemetry", "typed_config": provider},
        "random_sampling": {"value": t.sampling_percent},
    }


def otel_cluster(
    t: EnvoyTracing, cluster_type: str, endpoints: list[dict[str, Any]]
) -> dict[str, Any]:
    """The cluster of the collector (``cluster_type`` and ``endpoints`` as the bootstrap
    renders its clusters' for the collector's address)."""
    c = t.collector
    cluster: dict[str, Any] = {
        "name": OTEL_CLUSTER,
        "type": cluster_type,
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": OTEL_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}],
        },
    }
    if c.protocol == "grpc":
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    if c.tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": c.host,
            },
        }
    return cluster
