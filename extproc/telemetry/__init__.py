"""OpenTelemetry for the gateway: one span per request, joined to Envoy's trace and named after
the GenAI semantic conventions, with the quota decision as attributes; the ``gen_ai.*`` metrics
and the gateway's decision counters over OTLP, beside Prometheus (docs/observability.md).

Configured by OpenTelemetry's standard environment variables; with no OTLP endpoint set,
:func:`from_env` returns :data:`NOOP` without importing OpenTelemetry, and every hook the server
calls returns at once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from extproc.telemetry.base import NOOP, NOOP_TRACE, RequestTrace, Telemetry
from extproc.telemetry.settings import OtelConfigError, OtelSettings

__all__ = [
    "NOOP",
    "NOOP_TRACE",
    "OtelConfigError",
    "OtelSettings",
    "RequestTrace",
    "Telemetry",
    "check_env",
    "from_env",
]


def check_env(env: Mapping[str, str] | None = None) -> OtelSettings:
    """Read the OTEL_* variables and, when something is exported, check that the exporters can
    load (:class:`OtelConfigError` naming what is wrong): at start, before anything runs."""
    settings = OtelSettings.from_env(os.environ if env is None else env)
    if settings.enabled:
        from extproc.telemetry.otel import check_proto_modules

        check_proto_modules()
    return settings


def from_env(env: Mapping[str, str] | None = None) -> Telemetry:
    """The process's telemetry as the environment configures it (:data:`NOOP` when nothing
    is exported)."""
    settings = OtelSettings.from_env(os.environ if env is None else env)
    if not settings.enabled:
        return NOOP
    from extproc.telemetry.otel import OtelTelemetry

    return OtelTelemetry.from_settings(settings)
