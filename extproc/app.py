"""Composition root: config, Redis limiter, metrics, the gRPC server, health, graceful shutdown.

Health (``grpc.health.v1``, checked by Envoy's active health check on the ext_proc cluster):
the overall service ``""`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` report
NOT_SERVING until the rules are loaded and Redis has answered once, then SERVING.  A later Redis
outage does not flip them (every replica shares Redis: taking every replica out would fail all
traffic, where the plans' ``failure_mode`` decides per plan).  The service ``aiquota.v1.Redis``
reports whether this replica's Redis answers now (a PING every 2 s), for whoever wants to watch
or gate on it; the gauge ``aiq_redis_reachable`` follows it (an idle replica sees Redis go too).
The service ``aiquota.v1.Config`` reports NOT_SERVING while the last SIGHUP reload failed (the
replica runs its previous rules; gauge ``aiq_config_reload_failed``), SERVING once rules load.

Shutdown (SIGTERM/SIGINT), in order:

1. health NOT_SERVING, while every stream, new ones included, is still served for
   ``drain_notice_s`` (Envoy's health check notices and sends new requests elsewhere);
2. the server stops accepting streams (new ones are refused, and Envoy retries them on another
   replica) and the open ones run on, up to ``shutdown_grace_s``; requests waiting for a turn
   after that are told now (a 429 with their turn as ``retry-after``), those whose turn comes
   within it wait on;
3. streams still open then are ended with the ``server_shutdown`` cut event and settled;
4. in-flight and kept settlements are flushed, the Redis pool is closed, the process exits.

The RLS API (envoyproxy/ratelimit's ``ShouldRateLimit``, :mod:`extproc.rls`, docs/rls.md) is
served only when an RLS config is given (``AIQ_RLS_CONFIG`` / ``--rls-config``; without one a
``ShouldRateLimit`` call gets UNIMPLEMENTED and the health service does not answer for it), by
the same server unless ``AIQ_RLS_ADDRESS`` names its own; its config is reloaded on SIGHUP and
when its files change.

SIGHUP reloads the rules and applies the failure settings (``failure.timeout_ms``,
``failure.breaker_cooldown_ms``) to the live limiter; nothing in the rules file needs a restart.

Tenants and keys from the Redis admin store (``extproc.admin``, docs/admin.md) are merged into
the rules: every replica follows the store (``AIQ_ADMIN_STORE``) and swaps the merged rules in
when it changes; a SIGHUP reload merges the store into the new file.  ``--admin-port`` serves
the admin API.

The port answers only its callers (:mod:`extproc.access`, docs/security.md): ext_proc and RLS
need Envoy's bearer token or client certificate, the usage API a tenant's key or the admin
token; health stays open.  TLS comes from ``AIQ_GRPC_TLS_*``; a port without any credential
starts only with ``AIQ_INSECURE=1`` (``--insecure``), and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from extproc.access import PortGuard, PortSecurity
from extproc.access import build as build_security
from extproc.caller_tokens import AccessConfigError
from extproc.clock import Clock, SystemClock
from extproc.config import load_config
from extproc.config.load import load_config_text
from extproc.config.runtime import RuntimeConfig
from extproc.config.version import config_version
from extproc.gateway import Gateway
from extproc.limiter.allowance import AllowanceLimiter, AllowanceSettings
from extproc.limiter.base import Limiter
from extproc.limiter.redis import RedisLimiter
from extproc.limiter.redis_url import check_master
from extproc.metrics import Metrics
from extproc.ports import ListenError, add_grpc_port, serve_metrics
from extproc.records.writer import make_recorder
from extproc.server.servicer import ExternalProcessorServicer
from extproc.settings import Settings
from extproc.telemetry import from_env as telemetry_from_env
from extproc.tokenizers import TokenizerLoadError

log = structlog.get_logger("extproc")


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
_HEALTH_NAMES = ("", EXT_PROC_SERVICE, RLS_SERVICE)
#: The health name that follows Redis (SERVING while it answers a PING).
REDIS_HEALTH = "aiquota.v1.Redis"
#: The health name that follows the rules file: NOT_SERVING while the last reload failed.
CONFIG_HEALTH = "aiquota.v1.Config"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def load_rules(path: str) -> tuple[RuntimeConfig, str]:
    """Load the rules file once; the config and its version hash come from the same text."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return load_config(path), ""  # load_config raises the usual ConfigError
    cfg = load_config_text(text, source=str(p), base_dir=p.parent)
    return cfg, config_version(text)


def apply_failure_settings(limiter: Limiter, cfg: RuntimeConfig) -> None:
    """Give a live Redis limiter the rules' timeout and breaker cool-down (no-op otherwise)."""
    configure = getattr(limiter, "configure", None)
    if configure is not None:
        configure(timeout_ms=cfg.redis_timeout_ms, cooldown_ms=cfg.breaker_cooldown_ms)


@dataclass
class Running:
    """A started server and what it needs to stop cleanly."""

    server: Any
    gateway: Gateway
    port: int
    health: health_aio.HealthServicer = field(default_factory=health_aio.HealthServicer)
    ready_task: asyncio.Task[None] | None = None
    stopping: bool = False
    admin: Any = None  # extproc.admin.runtime.AdminRuntime: the store followed, admin API
    rls: Any = None  # extproc.rls.service.RlsRuntime: the RLS API's config and counters
    rls_server: Any = None  # the RLS API's own server when AIQ_RLS_ADDRESS is set
    rls_port: int = 0
    health_server: Any = None  # grpc.health.v1 alone, plaintext, at AIQ_HEALTH_ADDRESS
    _health_updates: set[asyncio.Task[None]] = field(default_factory=set)

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING on every health name we answer for."""
        for name in _HEALTH_NAMES:
            if name == RLS_SERVICE and self.rls is None:
                continue  # no RLS config: the RLS API is not served
            await self.health.set(name, _SERVING if serving else _NOT_SERVING)

    def note_reload(self, ok: bool) -> None:
        """A rules reload worked or failed: the gauge and the ``aiquota.v1.Config`` health."""
        self.gateway.metrics.config_reload_failed.set(0 if ok else 1)
        try:
            task = asyncio.get_running_loop().create_task(
                self.health.set(CONFIG_HEALTH, _SERVING if ok else _NOT_SERVING)
            )
        except RuntimeError:  # no event loop (a synchronous caller): the gauge alone
            return
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def wait_ready(self, interval_s: float = 0.5, watch_s: float = 2.0) -> None:
        """NOT_SERVING until Redis answers a PING, then SERVING; from then on
        ``aiquota.v1.Redis`` follows a PING every ``watch_s`` (runs as a task)."""
        ping = getattr(self.gateway.limiter, "ping", None)
        ready, redis_ok = False, None
        while not self.stopping:
            ok = ping is None or await ping()
            if ok != redis_ok:
                await self.health.set(REDIS_HEALTH, _SERVING if ok else _NOT_SERVING)
                self.gateway.metrics.redis_reachable.set(1 if ok else 0)
                if ready:
                    (log.info if ok else log.warning)("redis_health", serving=ok)
                redis_ok = ok
            if ok and not ready:
                await self.set_serving(True)
                log.info("health_serving")
                ready = True
            elif not ready:
                log.warning("redis_not_answering_yet", retry_in_s=interval_s)
            await asyncio.sleep(watch_s if ready else interval_s)

    async def stop(self, grace: float = 10.0, *, notice: float = 0.0) -> None:
        """Drain: NOT_SERVING for ``notice`` s while serving on, stop accepting, let in-flight
        streams end within ``grace``, cut the rest with a well-formed event, settle, close."""
        self.stopping = True
        if self.ready_task is not None:
            self.ready_task.cancel()
        await self.health.enter_graceful_shutdown()
        if notice > 0:
            log.info("draining", notice_s=notice, in_flight=len(self.gateway.active))
            await asyncio.sleep(notice)
        self.gateway.start_draining(grace)
        loop = asyncio.get_running_loop()
        # The server's own grace is longer than ours: streams still open at our deadline are
        # cut by us (an error event the client can read), not cancelled by grpc.
        stopping = asyncio.create_task(self.server.stop(grace + 2.0))
        if self.rls_server is not None:
            await self.rls_server.stop(1.0)
        if self.health_server is not None:
            await self.health_server.stop(0.5)
        if self.rls is not None:
            await self.rls.close()
        deadline = loop.time() + grace
        while self.gateway.active and loop.time() < deadline:  # noqa: ASYNC110 - polls a set
            await asyncio.sleep(0.05)
        if self.gateway.active:
            cut = await self.gateway.background.cut_streams_for_shutdown()
            log.warning("streams_cut_at_shutdown", count=cut)
        await stopping
        await self.gateway.background.drain_settlements(grace)
        if self.gateway.recorder is not None:
            await self.gateway.recorder.close(grace)
        if self.admin is not None:
            await self.admin.close()
        await self.gateway.background.close_input_stops()
        await self.gateway.limiter.close()
        await asyncio.to_thread(self.gateway.telemetry.close, grace)  # flush spans, metrics


def port_security(settings: Settings, metrics: Metrics) -> PortSecurity:
    """The gRPC port's TLS credentials and credential guard (docs/security.md); raises
    :class:`extproc.access.AccessConfigError` for settings that would leave it open by
    accident.  The usage API's admin is whoever holds the admin API's token."""
    from extproc.admin.auth import TokenFile
    from extproc.admin.errors import AdminConfigError

    try:
        admin_token = TokenFile(settings.admin_token_file) if settings.admin_token_file else None
    except AdminConfigError as exc:
        raise AccessConfigError(str(exc)) from exc
    return build_security(
        address=settings.grpc_address,
        insecure=settings.insecure,
        token_file=settings.grpc_token_file,
        tls_cert=settings.grpc_tls_cert,
        tls_key=settings.grpc_tls_key,
        client_ca=settings.grpc_tls_client_ca,
        allowed_sans=settings.allowed_sans,
        allow_plaintext=settings.grpc_allow_plaintext,
        admin_token=admin_token,
        refused=metrics.grpc_refused,
        # a listener of its own only when the RLS API is served (without a config it is not)
        rls_address=settings.rls_address if settings.rls_config else "",
    )


def _add_usage_service(server: Any, gateway: Gateway, guard: PortGuard) -> None:
    try:
        from extproc.usage.service import add_usage_service
    except ImportError:  # generated protobuf code missing (package not built)
        log.warning(
            "usage_service_unavailable", reason="generated code missing; reinstall the package"
        )
        return
    add_usage_service(server, gateway, guard)


async def start(
    settings: Settings,
    *,
    config: RuntimeConfig | None = None,
    limiter: Limiter | None = None,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
) -> Running:
    """Build everything and start serving on ``settings.grpc_address`` (port 0: pick one)."""
    version = ""
    if config is None:
        cfg, version = load_rules(settings.config)
    else:
        cfg = config
    clk = clock or SystemClock(settings.clock_offset_ms)
    mets = metrics or Metrics()
    security = port_security(settings, mets)  # before anything opens a connection
    if limiter is None:
        await check_master(settings.redis_url)  # a Sentinel master name no sentinel knows
    redis_lim = limiter or RedisLimiter.from_url(
        settings.redis_url,
        timeout_ms=cfg.redis_timeout_ms,
        cooldown_ms=cfg.breaker_cooldown_ms,
        clock=clk,
        metrics=mets,
        journal_s=settings.redis_journal_s,
        stream_tolerance_s=settings.redis_stream_tolerance_s,
        failover_wait_s=settings.redis_failover_wait_s,
    )
    lim: Limiter = redis_lim
    if settings.allowances and isinstance(redis_lim, RedisLimiter):
        lim = AllowanceLimiter(
            redis_lim,
            AllowanceSettings(
                share=settings.allowance_share,
                ttl_ms=settings.allowance_ttl_ms,
                min_rate=settings.allowance_min_rate,
                max_window_s=settings.allowance_max_window_s,
                tranches=settings.allowance_tranches,
                lease_ms=cfg.reservation_lease_ms,
                draft_flush_ms=settings.allowance_draft_flush_ms,
            ),
            clock=clk,
            metrics=mets,
        )
    gw = Gateway(
        config=cfg,
        limiter=lim,
        clock=clk,
        metrics=mets,
        key_prefix=settings.key_prefix,
        # In-process tests that bring their own limiter write no usage records.
        recorder=make_recorder(settings, mets) if limiter is None else None,
        telemetry=telemetry_from_env(),  # OTEL_* variables; a no-op when none is set
    )
    gw.install(cfg, version)
    admin = None
    rls = None
    try:
        if config is None and limiter is None and settings.admin_store:
            admin = await _start_admin(settings, gw)
        options = [("grpc.so_reuseport", 1 if settings.workers > 1 or settings.reuse_port else 0)]
        server = grpc.aio.server(options=options, interceptors=[security.guard])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessorServicer(gw), server)
        _add_usage_service(server, gw, security.guard)
        health = health_aio.HealthServicer()
        for name in (*_HEALTH_NAMES, REDIS_HEALTH):
            if name != RLS_SERVICE or settings.rls_config:
                await health.set(name, _NOT_SERVING)
        await health.set(CONFIG_HEALTH, _SERVING)  # the rules loaded, or start() failed
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        from extproc.rls.serving import start_rls  # the RLS modules load only when used

        rls, rls_server, rls_port = start_rls(
            settings,
            gw,
            redis_lim,
            clk,
            mets,
            server=server,
            options=options,
            health=health,
            security=security,
        )
        port = add_grpc_port(
            server,
            settings.grpc_address,
            what="ext_proc gRPC API",
            credentials=security.credentials(),
        )
        health_server = None
        if settings.health_address:
            health_server = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
            add_grpc_port(health_server, settings.health_address, what="health (plaintext)")
        await server.start()
        if rls_server is not None:
            await rls_server.start()
        if health_server is not None:
            await health_server.start()
    except BaseException:
        # What was built so far holds connections and tasks: close it, or the process hangs
        # on its way out instead of reporting the error.
        await _close_partial(gw, admin, rls)
        raise
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
        tls=security.tls,
        mutual_tls=security.guard.client_certs,
        caller_tokens=security.guard.tokens is not None,
    )
    if cfg.plaintext_keys:
        log.warning(
            "plaintext_keys_in_config", count=cfg.plaintext_keys, note="for local demos only"
        )
    running = Running(
        server=server,
        gateway=gw,
        port=port,
        health=health,
        admin=admin,
        rls=rls,
        rls_server=rls_server,
        rls_port=(rls_port or port) if rls is not None else 0,
        health_server=health_server,
    )
    running.ready_task = asyncio.create_task(running.wait_ready())
    return running


async def _close_partial(gw: Gateway, admin: Any, rls: Any = None) -> None:
    """Close what a failed ``start`` had built (admin store follower, RLS config watch,
    recorder, limiter)."""
    if admin is not None:
        with contextlib.suppress(Exception):
            await admin.close()
    if rls is not None:
        with contextlib.suppress(Exception):
            await rls.close()
    if gw.recorder is not None:
        with contextlib.suppress(Exception):
            await gw.recorder.close(0.0)
    with contextlib.suppress(Exception):
        await gw.limiter.close()


async def _start_admin(settings: Settings, gw: Gateway) -> Any:
    """Follow the admin store (each change swaps the merged rules in) and serve the admin API
    when ``settings.admin_port`` is set."""
    from extproc.admin.runtime import start_admin

    def apply(eff: Any) -> None:
        gw.install(eff.config, eff.version)

    return await start_admin(settings, apply, version_of=config_version, metrics=gw.metrics)


def _redact(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def reload_rules(running: Running, path: str) -> bool:
    """SIGHUP: load the rules file again and swap it in, failure settings included; a file
    that does not load leaves the running rules untouched.  Whether it worked."""
    metrics = running.gateway.metrics
    try:
        if running.admin is not None:
            cfg, version = running.admin.reload_file(path)
        else:
            cfg, version = load_rules(path)
    except Exception as exc:
        metrics.config_reloads.labels("error").inc()
        if isinstance(exc.__cause__, TokenizerLoadError):
            metrics.tokenizer_load_failures.inc()
        log.error("config_reload_failed", error=str(exc))
        running.note_reload(False)
        return False
    running.gateway.install(cfg, version)
    apply_failure_settings(running.gateway.limiter, cfg)
    metrics.config_reloads.labels("ok").inc()
    running.note_reload(True)
    log.info(
        "config_reloaded",
        config=path,
        version=version,
        redis_timeout_ms=cfg.redis_timeout_ms,
        breaker_cooldown_ms=cfg.breaker_cooldown_ms,
    )
    return True


async def serve_forever(settings: Settings) -> int:
    """Run until SIGINT/SIGTERM (then drain); reload the rules on SIGHUP without dropping
    streams."""
    running = await start(settings)
    if settings.metrics_port:
        try:
            serve_metrics(
                settings.metrics_port, settings.metrics_host, running.gateway.metrics.registry
            )
        except ListenError:
            await running.stop(0.0)  # nothing was served yet: close what start() opened
            raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_hup() -> None:
        reload_rules(running, settings.config)
        if running.rls is not None:
            running.rls.reload()

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    await stop.wait()
    log.info("shutting_down", in_flight=len(running.gateway.active))
    with contextlib.suppress(NotImplementedError):
        loop.remove_signal_handler(signal.SIGHUP)
    await running.stop(settings.shutdown_grace_s, notice=settings.drain_notice_s)
    log.info("stopped")
    return 0
