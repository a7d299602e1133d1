"""What the OpenTelemetry export is configured with: OpenTelemetry's own environment variables,
read here only as far as the gateway must decide something itself (whether to export at all,
which OTLP transport, what Envoy's tracer is pointed at).  The SDK and the exporters read the
rest themselves (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``
and ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_BSP_*`` ...).

Pure: no OpenTelemetry import, so that a process with nothing configured pays one dict lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

#: The service name the processors report when ``OTEL_SERVICE_NAME`` is unset.
DEFAULT_SERVICE_NAME = "ai-quota"
#: The service name ``ai-quota envoy-config`` gives Envoy's tracer.
ENVOY_SERVICE_NAME = "ai-quota-envoy"

PROTOCOLS = ("grpc", "http/protobuf")

_ENDPOINTS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)


class OtelConfigError(ValueError):
    """An OpenTelemetry variable the gateway cannot use (a clear message at start-up)."""


@dataclass(frozen=True, slots=True)
class OtelSettings:
    """Whether traces and metrics go out over OTLP, and how."""

    traces: bool = False
    metrics: bool = False
    # OTEL_EXPORTER_OTLP_PROTOCOL (the per-signal variables override it)
    traces_protocol: str = "grpc"
    metrics_protocol: str = "grpc"
    # the traces endpoint as configured (Envoy's tracer is pointed at it too)
    traces_endpoint: str = ""
    service_name: str = DEFAULT_SERVICE_NAME
    # OTEL_METRIC_EXPORT_INTERVAL / _TIMEOUT (milliseconds)
    metric_interval_ms: float = 60_000.0
    metric_timeout_ms: float = 30_000.0

    @property
    def enabled(self) -> bool:
        """Anything to export."""
        return self.traces or self.metrics

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OtelSettings:
        """Read the variables (``OTEL_SDK_DISABLED=true`` turns everything off, as in every
        OpenTelemetry SDK; ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` ``none`` turn
        one signal off)."""
        if not any(env.get(k) for k in _ENDPOINTS):
            return _OFF  # the common case: one look per variable, nothing else
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return _OFF
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        traces_ep = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or base
        metrics_ep = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip() or base
        protocol = _protocol(env, "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        return cls(
            traces=bool(traces_ep) and _exporter_on(env, "OTEL_TRACES_EXPORTER"),
            metrics=bool(metrics_ep) and _exporter_on(env, "OTEL_METRICS_EXPORTER"),
            traces_protocol=_protocol(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol),
            metrics_protocol=_protocol(env, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", protocol),
            traces_endpoint=traces_ep,
            service_name=_service_name(env),
            metric_interval_ms=_millis(env, "OTEL_METRIC_EXPORT_INTERVAL", 60_000.0),
            metric_timeout_ms=_millis(env, "OTEL_METRIC_EXPORT_TIMEOUT", 30_000.0),
        )


_OFF = OtelSettings()


def _protocol(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in PROTOCOLS:
        raise OtelConfigError(
            f"{name}={value!r}: the gateway exports OTLP over 'grpc' or 'http/protobuf'"
        )
    return value


def _service_name(env: Mapping[str, str]) -> str:
    """``OTEL_SERVICE_NAME``; else empty when ``OTEL_RESOURCE_ATTRIBUTES`` names the service
    (the SDK takes it from there); else :data:`DEFAULT_SERVICE_NAME`."""
    name = env.get("OTEL_SERVICE_NAME", "").strip()
    if name:
        return name
    attrs = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if any(kv.split("=", 1)[0].strip() == "service.name" for kv in attrs.split(",")):
        return ""
    return DEFAULT_SERVICE_NAME


def _millis(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise OtelConfigError(f"{name}={raw!r}: expected a positive number of milliseconds")
    return value


def _exporter_on(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "otlp"):
        return True
    if value == "none":
        return False
    raise OtelConfigError(f"{name}={value!r}: the gateway exports with 'otlp' only (or 'none')")


@dataclass(frozen=True, slots=True)
class CollectorAddress:
    """Where an OTLP endpoint URL points: what Envoy's tracer needs (a cluster's address)."""

    host: str
    port: int
    tls: bool
    protocol: str  # grpc or http/protobuf
    path: str = ""  # http/protobuf: the traces path

    @classmethod
    def of(cls, endpoint: str, protocol: str, *, signal_path: bool = False) -> CollectorAddress:
        """Parse an endpoint such as ``http://otel-collector:4317`` (no scheme: ``http``).
        The default port is OTLP's for the protocol (4317 gRPC, 4318 HTTP).  Over HTTP a base
        endpoint gets ``/v1/traces`` appended and a traces endpoint (``signal_path``) is used as
        it is: the SDKs' rule."""
        url = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise OtelConfigError(
                f"OTLP endpoint {endpoint!r}: expected http(s)://host[:port] (e.g. "
                "http://otel-collector:4317)"
            )
        try:
            port = url.port or (4317 if protocol == "grpc" else 4318)
        except ValueError as exc:
            raise OtelConfigError(f"OTLP endpoint {endpoint!r}: {exc}") from exc
        path = ""
        if protocol != "grpc":
            path = url.path or "/" if signal_path else url.path.rstrip("/") + "/v1/traces"
        return cls(url.hostname, port, url.scheme == "https", protocol, path)


def collector_for_envoy(env: Mapping[str, str]) -> CollectorAddress | None:
    """Where Envoy's own tracer should send its spans: the processors' traces endpoint, or
    None when no traces are exported."""
    s = OtelSettings.from_env(env)
    if not s.traces:
        return None
    signal = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip())
    return CollectorAddress.of(s.traces_endpoint, s.traces_protocol, signal_path=signal)
