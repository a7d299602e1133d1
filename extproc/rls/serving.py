"""Putting the RLS API on the gateway's gRPC port, or on a port of its own
(``AIQ_RLS_ADDRESS``): the runtime built from the settings, its counter on the limiter's store
(:func:`extproc.limiter.rls_counter.rls_counter`), behind the port's guard and TLS."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc

from extproc.limiter.rls_counter import rls_counter
from extproc.ports import add_grpc_port
from extproc.rls.request import Caps
from extproc.rls.service import RlsRuntime, RlsSettings, add_rls_service

if TYPE_CHECKING:
    from extproc.access import PortSecurity
    from extproc.clock import Clock
    from extproc.gateway import Gateway
    from extproc.limiter.base import Limiter
    from extproc.metrics import Metrics
    from extproc.settings import Settings

log = structlog.get_logger("extproc")


def start_rls(
    settings: Settings,
    gateway: Gateway,
    limiter: Limiter,
    clock: Clock,
    metrics: Metrics,
    *,
    server: Any,
    options: list[tuple[str, int]],
    health: Any,
    security: PortSecurity,
) -> tuple[Any, Any, int]:
    """The RLS API (docs/rls.md) on the ext_proc server, or on its own at
    ``settings.rls_address``: (runtime, own server or None, its port or 0).  Without an RLS
    config nothing is registered: (None, None, 0)."""
    if not settings.rls_config:
        if settings.rls_address:
            log.warning(
                "rls_address_without_config",
                rls_address=settings.rls_address,
                note="AIQ_RLS_ADDRESS is ignored: no RLS config (AIQ_RLS_CONFIG), no RLS API",
            )
        return None, None, 0

    rls = RlsRuntime(
        settings.rls_config,
        rls_counter(limiter),
        clock,
        metrics.registry,
        RlsSettings(
            failure_mode=settings.rls_failure_mode,
            near_limit_ratio=settings.rls_near_limit_ratio,
            shadow_mode=settings.rls_shadow_mode,
            response_headers=settings.rls_response_headers,
            dynamic_metadata=settings.rls_dynamic_metadata,
            key_prefix=settings.key_prefix,
            caps=Caps(
                descriptors=settings.rls_max_descriptors,
                entries=settings.rls_max_entries,
                key_length=settings.rls_max_key_length,
                value_length=settings.rls_max_value_length,
                hits_addend=settings.rls_max_hits_addend,
            ),
            detailed_metric_series=settings.rls_detailed_metric_series,
        ),
        # an ai_quota link charges only the tenants, models and levels of the running rules
        known=lambda: (
            gateway.config.tenants,
            gateway.config.models,
            gateway.config.organisations,
        ),
    )
    if not settings.rls_address:
        add_rls_service(server, rls)
        rls.start_watching(settings.rls_watch_s)
        return rls, None, 0
    own = grpc.aio.server(options=options, interceptors=[security.guard])
    add_rls_service(own, rls)
    health_pb2_grpc.add_HealthServicer_to_server(health, own)
    port = add_grpc_port(
        own, settings.rls_address, what="RLS API", credentials=security.credentials()
    )
    rls.start_watching(settings.rls_watch_s)  # once bound: a failed start leaves no task
    return rls, own, port
