"""``envoy.service.ratelimit.v3.RateLimitService``: envoyproxy/ratelimit's API on our counters.

:class:`RlsRuntime` holds the loaded config (swapped whole on reload: a file change or
SIGHUP; a config that does not load leaves the running one in place), the settings and the
metrics; :class:`RateLimitServicer` is the gRPC face.  Each ``ShouldRateLimit`` is one Lua
call over every counter of the request (:class:`extproc.limiter.base.RlsCounter`: Redis's in
:mod:`extproc.limiter.rls_counter`), all or nothing;
descriptors that need no counter (no rule, ``unlimited``, replaced) never touch Redis.

When Redis is unavailable (timeout, refused connection, open breaker: the limiter's
bounded timeout and circuit breaker answer within ``failure.timeout_ms``), ``failure_mode``
decides: ``allow`` answers OK, ``deny`` answers OVER_LIMIT, ``error`` answers the gRPC status
UNAVAILABLE so that Envoy's own ``failure_mode_deny`` decides (what envoyproxy/ratelimit does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import ratelimit_unit_pb2
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry, Counter

from extproc.clock import Clock
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import RlsCounter
from extproc.rls import match
from extproc.rls.config import RlsConfig, RlsConfigError
from extproc.rls.load import load_path, signature

log = structlog.get_logger("extproc.rls")

RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
FailureMode = Literal["allow", "deny", "error"]
HEADER_NAMES = ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset")
_UNIT = rls_pb2.RateLimitResponse.RateLimit.Unit
_OVERRIDE_UNITS = {v: k.lower() for k, v in ratelimit_unit_pb2.RateLimitUnit.items()}


@dataclass(frozen=True, slots=True)
class RlsSettings:
    """How the service answers (process settings: ``AIQ_RLS_*``)."""

    failure_mode: FailureMode = "error"
    near_limit_ratio: float = 0.8
    shadow_mode: bool = False
    response_headers: bool = False
    dynamic_metadata: bool = False
    key_prefix: str = "aiq"
    caps: match.Caps = field(default_factory=match.Caps)
    detailed_metric_series: int = 100  # per rule: distinct detailed_metric label values


#: What an ai_quota link may charge: (tenants, canonical models, organisation -> its teams) of
#: the running rules.
KnownBuckets = Callable[[], tuple[Container[str], Container[str], Mapping[str, tuple[str, ...]]]]


class RlsMetrics:
    """Per rule (their stat names, as labels): hits, over/near/within the limit, shadow.

    Label values come from the config only: ``domain`` is a configured domain, ``rule`` a
    configured rule's path, ``override`` for every descriptor counted by a ``limit`` override,
    and with ``detailed_metric`` the request's values for at most ``detailed_series`` distinct
    values per rule (per process); the rest are counted under the rule's path.  Unknown domains
    are one unlabelled counter.  No caller text makes the number of series grow past that."""

    def __init__(self, registry: CollectorRegistry, detailed_series: int = 100) -> None:
        labels = ["domain", "rule"]
        r = registry
        self.total_hits = Counter(
            "aiq_rls_total_hits", "RLS hits per rule (hits_addend summed)", labels, registry=r
        )
        self.over_limit = Counter(
            "aiq_rls_over_limit", "RLS hits over the rule's limit", labels, registry=r
        )
        self.near_limit = Counter(
            "aiq_rls_near_limit",
            "RLS hits past the near-limit ratio of the rule's limit (AIQ_RLS_NEAR_LIMIT_RATIO)",
            labels,
            registry=r,
        )
        self.within_limit = Counter(
            "aiq_rls_within_limit", "RLS hits within the rule's limit", labels, registry=r
        )
        self.shadow_mode = Counter(
            "aiq_rls_shadow_mode",
            "RLS hits over a shadow-mode rule's limit (answered OK)",
            labels,
            registry=r,
        )
        self.global_shadow_mode = Counter(
            "aiq_rls_global_shadow_mode",
            "RLS requests that would have been refused, answered OK by AIQ_RLS_SHADOW_MODE",
            registry=r,
        )
        self.requests = Counter(
            "aiq_rls_requests", "ShouldRateLimit calls by answer", ["code"], registry=r
        )
        self.config_loads = Counter(
            "aiq_rls_config_loads", "RLS config loads by outcome", ["outcome"], registry=r
        )
        self.unknown_domain = Counter(
            "aiq_rls_unknown_domain",
            "ShouldRateLimit calls for a domain the config does not have (answered OK, "
            "nothing counted)",
            registry=r,
        )
        self.overrides_ignored = Counter(
            "aiq_rls_overrides_ignored",
            "Descriptor limit overrides ignored: their domain does not set allow_limit_override",
            ["domain"],
            registry=r,
        )
        self.detailed_series = detailed_series
        self._rules: dict[tuple[str, str], tuple[Any, Any, Any, Any, Any]] = {}
        self._detailed: dict[tuple[str, str], int] = {}  # (domain, rule path): values labelled

    def add(self, domain: str, stats: tuple[match.RuleStats, ...]) -> None:
        """Count one decision's per-rule stats."""
        for st in stats:
            total, over, near, within, shadow = self._children(domain, self._label(domain, st))
            total.inc(st.total_hits)
            if st.over_limit:
                over.inc(st.over_limit)
            if st.near_limit:
                near.inc(st.near_limit)
            if st.within_limit:
                within.inc(st.within_limit)
            if st.shadow_mode:
                shadow.inc(st.shadow_mode)

    def _children(self, domain: str, rule: str) -> tuple[Any, Any, Any, Any, Any]:
        """The five counters of a rule (looked up once per rule and kept)."""
        got = self._rules.get((domain, rule))
        if got is None:
            got = (
                self.total_hits.labels(domain, rule),
                self.over_limit.labels(domain, rule),
                self.near_limit.labels(domain, rule),
                self.within_limit.labels(domain, rule),
                self.shadow_mode.labels(domain, rule),
            )
            self._rules[(domain, rule)] = got
        return got

    def _label(self, domain: str, st: match.RuleStats) -> str:
        """The ``rule`` label of a stat: its name while the rule has labelled fewer than
        ``detailed_series`` distinct values, else the rule's path."""
        if st.name == st.rule.path or (domain, st.name) in self._rules:
            return st.name
        seen = self._detailed.get((domain, st.rule.path), 0)
        if seen >= self.detailed_series:
            return st.rule.path
        self._detailed[(domain, st.rule.path)] = seen + 1
        return st.name


class RlsRuntime:
    """The loaded config, the counters and the settings of the RLS API in this process."""

    def __init__(
        self,
        path: str,
        counters: RlsCounter | None,
        clock: Clock,
        registry: CollectorRegistry,
        settings: RlsSettings | None = None,
        *,
        known: KnownBuckets | None = None,
    ) -> None:
        self.path = path
        self.counters = counters
        self.clock = clock
        self.settings = settings or RlsSettings()
        self.known = known
        self.metrics = RlsMetrics(registry, self.settings.detailed_metric_series)
        self.config = RlsConfig()
        self._signature: tuple[tuple[str, int, int], ...] = ()
        self._watch: asyncio.Task[None] | None = None
        if path:
            self.config = load_path(path)  # a bad config at start-up is fatal (raises)
            self._signature = signature(path)
            self.metrics.config_loads.labels("ok").inc()

    def reload(self) -> bool:
        """Load the config again and swap it in whole; a config that does not load leaves the
        running one in place.  Whether it was swapped."""
        if not self.path:
            return False
        self._signature = signature(self.path)
        try:
            cfg = load_path(self.path)
        except RlsConfigError as exc:
            self.metrics.config_loads.labels("error").inc()
            log.error("rls_config_reload_failed", path=self.path, errors=exc.errors)
            return False
        self.config = cfg
        self.metrics.config_loads.labels("ok").inc()
        log.info("rls_config_reloaded", path=self.path, domains=sorted(cfg.domains))
        return True

    def start_watching(self, interval_s: float = 1.0) -> None:
        """Reload when a config file changes (polled every ``interval_s``)."""
        if self.path and interval_s > 0 and self._watch is None:
            self._watch = asyncio.create_task(self._poll(interval_s))

    async def _poll(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if signature(self.path) != self._signature:
                self.reload()

    async def close(self) -> None:
        """Stop watching the files."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def evaluate(self, request: Any) -> Any:
        """Answer one ``RateLimitRequest`` (:class:`match.RequestError` on a bad one;
        :class:`LimiterUnavailable` when Redis fails and the failure mode is ``error``)."""
        s = self.settings
        descriptors = [_descriptor(d) for d in request.descriptors]
        tenants, models, organisations = (
            self.known() if self.known is not None else (None, None, None)
        )
        p = match.plan(
            self.config,
            request.domain,
            descriptors,
            int(request.hits_addend),
            self.clock.now_ms(),
            prefix=s.key_prefix,
            global_shadow=s.shadow_mode,
            caps=s.caps,
            tenants=tenants,
            models=models,
            organisations=organisations,
        )
        if not p.known_domain:
            self.metrics.unknown_domain.inc()
        if p.overrides_ignored:
            self.metrics.overrides_ignored.labels(p.domain).inc(p.overrides_ignored)
        counted = p.counted
        failed = ""
        if counted:
            try:
                if self.counters is None:  # an in-process test's limiter
                    raise LimiterUnavailable("this limiter has no RLS counters")
                admitted, before = await self.counters.rls_check(
                    [(c.key, c.hits, c.limit, c.expire_at_ms, c.mode) for c in counted]
                )
            except LimiterUnavailable as exc:
                if s.failure_mode == "error":
                    raise
                failed = str(exc)
        else:
            admitted, before = True, []
        if failed:
            decision = match.fail_open(p) if s.failure_mode == "allow" else match.fail_closed(p)
            log.warning("rls_redis_unavailable", failure_mode=s.failure_mode, error=failed)
        else:
            decision = match.decide(
                p,
                before,
                admitted,
                near_ratio=s.near_limit_ratio,
                headers=HEADER_NAMES if s.response_headers else None,
            )
            self.metrics.add(p.domain, decision.stats)
            if decision.global_shadow_hit:
                self.metrics.global_shadow_mode.inc()
        code = "OVER_LIMIT" if decision.overall is match.Code.OVER_LIMIT else "OK"
        self.metrics.requests.labels(code).inc()
        if decision.overall is match.Code.OVER_LIMIT:
            log.debug("rls_decision", domain=p.domain, code=code, descriptors=len(p.items))
        return self._response(request, p, decision)

    def _response(self, request: Any, p: match.Plan, decision: match.Decision) -> Any:
        resp = rls_pb2.RateLimitResponse(overall_code=int(decision.overall))
        for st in decision.statuses:
            out = resp.statuses.add(code=int(st.code), limit_remaining=st.limit_remaining)
            if st.rule is not None:
                out.current_limit.requests_per_unit = st.rule.requests_per_unit
                out.current_limit.unit = _UNIT.Value(st.rule.unit.upper())
                if st.rule.name:
                    out.current_limit.name = st.rule.name
                out.duration_until_reset.seconds = st.reset_s
        for name, value in decision.headers:
            resp.response_headers_to_add.append(base_pb2.HeaderValue(key=name, value=value))
        if self.settings.dynamic_metadata:
            resp.dynamic_metadata.CopyFrom(_metadata(request, p, decision))
        return resp


def _descriptor(d: Any) -> match.Descriptor:
    entries = tuple((e.key, e.value) for e in d.entries)
    hits = d.hits_addend.value if d.HasField("hits_addend") else None
    override = None
    if d.HasField("limit"):
        unit = _OVERRIDE_UNITS.get(d.limit.unit, "unknown")
        if unit not in ("second", "minute", "hour", "day", "month", "year"):
            raise match.RequestError("a descriptor's limit override has no valid unit")
        override = (unit, int(d.limit.requests_per_unit))
    return match.Descriptor(entries, hits, override)


def _metadata(request: Any, p: match.Plan, decision: match.Decision) -> Any:
    """The request's descriptors (and the metadata of rules that passed) as a Struct, the
    shape envoyproxy/ratelimit gives Envoy's dynamic metadata."""
    doc: dict[str, Any] = {"domain": request.domain}
    descs = []
    for d in request.descriptors:
        one: dict[str, Any] = {"entries": [f"{e.key}={e.value}" for e in d.entries]}
        if d.HasField("hits_addend"):
            one["hitsAddend"] = d.hits_addend.value
        descs.append(one)
    doc["descriptors"] = descs
    if request.hits_addend:
        doc["hitsAddend"] = request.hits_addend
    passed: dict[str, Any] = {}
    for item, st in zip(p.items, decision.statuses, strict=True):
        if st.code is match.Code.OK and item.rule is not None and item.rule.metadata:
            for k, v in item.rule.metadata.items():
                passed.setdefault(k, v)
    if passed:
        doc["metadata"] = passed
    out = struct_pb2.Struct()
    out.update(doc)
    return out


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    """``envoy.service.ratelimit.v3.RateLimitService``."""

    def __init__(self, runtime: RlsRuntime) -> None:
        self.rt = runtime

    async def ShouldRateLimit(self, request: Any, context: Any) -> Any:  # noqa: N802
        """One decision; a bad request is INVALID_ARGUMENT, Redis down per the failure mode."""
        try:
            return await self.rt.evaluate(request)
        except match.RequestError as exc:
            self.rt.metrics.requests.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LimiterUnavailable as exc:
            self.rt.metrics.requests.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return None


def add_rls_service(server: Any, runtime: RlsRuntime) -> None:
    """Serve the RLS API on ``server``."""
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimitServicer(runtime), server)


def check_path(path: str) -> tuple[int, str]:
    """``ai-quota check-config`` for an RLS config: (exit code, text)."""
    started = time.perf_counter()
    try:
        cfg = load_path(path)
    except RlsConfigError as exc:
        return 1, str(exc)
    files = ", ".join(Path(s).name for s in cfg.sources)
    took = (time.perf_counter() - started) * 1000
    return 0, (
        f"{path}: OK (RLS config: {len(cfg.domains)} domain(s) "
        f"{', '.join(sorted(cfg.domains))}; {cfg.rules} rate limit(s); files: {files}; "
        f"{took:.0f} ms)\n{path}: reloaded on file change and on SIGHUP, whole or not at all"
    )
