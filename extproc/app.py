"""Composition root: config, Redis limiter, metrics, the gRPC server, graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import signal
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.clock import Clock, SystemClock
from extproc.config import load_config
from extproc.config.runtime import RuntimeConfig
from extproc.limiter.base import Limiter
from extproc.limiter.redis import RedisLimiter
from extproc.metrics import Metrics
from extproc.server.gateway import Gateway
from extproc.server.servicer import ExternalProcessorServicer
from extproc.settings import Settings

log = structlog.get_logger("extproc")


@dataclass
class Running:
    """A started server and what it needs to stop cleanly."""

    server: Any
    gateway: Gateway
    port: int

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting streams, let in-flight ones end, settle every request, close Redis."""
        self.gateway.draining = True
        await self.server.stop(grace)
        if self.gateway.pending:
            await asyncio.wait(list(self.gateway.pending), timeout=grace)
        await self.gateway.limiter.close()


def _add_usage_service(server: Any, gateway: Gateway) -> None:
    try:
        from extproc.usage.service import add_usage_service
    except ImportError:  # generated protobuf code missing (package not built)
        log.warning(
            "usage_service_unavailable", reason="generated code missing; reinstall the package"
        )
        return
    add_usage_service(server, gateway)


async def start(
    settings: Settings,
    *,
    config: RuntimeConfig | None = None,
    limiter: Limiter | None = None,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
) -> Running:
    """Build everything and start serving on ``settings.grpc_address`` (port 0: pick one)."""
    cfg = config or load_config(settings.config)
    clk = clock or SystemClock()
    lim = limiter or RedisLimiter.from_url(
        settings.redis_url,
        timeout_ms=cfg.redis_timeout_ms,
        cooldown_ms=cfg.breaker_cooldown_ms,
        clock=clk,
    )
    gw = Gateway(
        config=cfg,
        limiter=lim,
        clock=clk,
        metrics=metrics or Metrics(),
        key_prefix=settings.key_prefix,
    )
    options = [("grpc.so_reuseport", 1 if settings.workers > 1 or settings.reuse_port else 0)]
    server = grpc.aio.server(options=options)
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(gw), server)
    _add_usage_service(server, gw)
    port = server.add_insecure_port(settings.grpc_address)
    if port == 0:
        raise OSError(f"cannot listen on {settings.grpc_address} (address in use?)")
    await server.start()
    # Everything loaded so far (config, tokenizers, protobuf classes) lives for the whole
    # process: keep it out of the collector's full passes.
    gc.collect()
    gc.freeze()
    log.info(
        "serving",
        address=settings.grpc_address,
        port=port,
        config=cfg.source,
        redis=_redact(settings.redis_url),
        models=sorted(cfg.models),
        tenants=len(cfg.tenants),
        failure_mode=cfg.failure_mode,
    )
    if cfg.plaintext_keys:
        log.warning(
            "plaintext_keys_in_config", count=cfg.plaintext_keys, note="for local demos only"
        )
    return Running(server=server, gateway=gw, port=port)


def _redact(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


async def serve_forever(settings: Settings) -> int:
    """Run until SIGINT/SIGTERM; reload the rules on SIGHUP without dropping streams."""
    running = await start(settings)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(
            settings.metrics_port, addr="127.0.0.1", registry=running.gateway.metrics.registry
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:
        try:
            running.gateway.config = load_config(settings.config)
            log.info("config_reloaded", config=settings.config)
        except Exception as exc:
            log.error("config_reload_failed", error=str(exc))

    loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()
    log.info("shutting_down", in_flight=len(running.gateway.active))
    await running.stop(settings.shutdown_grace_s)
    log.info("stopped")
    return 0
