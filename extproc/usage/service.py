"""``aiquota.v1.Usage`` served beside the ext_proc service: current counters of a tenant."""

from __future__ import annotations

from typing import Any

import grpc

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.config.load import key_digest
from extproc.core.admission import format_amount
from extproc.core.keys import SLIDING_SCALE, WindowedBucket, windowed
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway


class UsageServicer(usage_pb2_grpc.UsageServicer):
    """Reads the counters of a tenant's buckets in their current windows."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def GetUsage(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Every bucket that applies to the tenant (and model, if given)."""
        cfg = self.gw.config
        key_name = ""
        tenant_id = request.tenant
        if request.api_key:
            key = cfg.keys_by_digest.get(key_digest(request.api_key))
            if key is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown API key")
            assert key is not None
            key_name, tenant_id = key.name, key.tenant
        tenant = cfg.tenants.get(tenant_id)
        if tenant is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tenant {tenant_id!r}")
        assert tenant is not None
        limits = tenant.limits
        if request.model:
            model = cfg.resolve_model(request.model)
            if model is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
            assert model is not None
            limits = tuple(lim for lim in limits if lim.applies_to(model.name))
        if not key_name:
            limits = tuple(lim for lim in limits if lim.scope == "tenant")
        now = self.gw.clock.now_ms()
        buckets = windowed(self.gw.key_prefix, tenant.id, key_name, limits, now)
        try:
            values = await self._values(buckets, now)
        except LimiterUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
        resp = usage_pb2.GetUsageResponse(
            tenant=tenant.id,
            plan=tenant.plan,
            key_name=key_name,
            config_version=self.gw.config_version,
        )
        for b, v in zip(buckets, values, strict=True):
            lim = b.limit
            money = lim.metric == "cost" and lim.unit != "weighted"
            resp.buckets.append(
                usage_pb2.Bucket(
                    metric=b.metric,
                    model=lim.model,
                    scope=lim.scope,
                    window_seconds=lim.window_s,
                    limit=lim.limit,
                    used=v,
                    remaining=max(0, lim.limit - v),
                    reset_seconds=b.reset_s(now) if lim.metric != "concurrency" else 0.0,
                    period=lim.period_name if lim.metric != "concurrency" else "",
                    unit=_UNITS.get(lim.metric, lim.unit),
                    limit_display=format_amount(lim, lim.limit) if money else str(lim.limit),
                    used_display=format_amount(lim, v) if money else str(v),
                    shadow=lim.shadow,
                    sliding=lim.sliding,
                )
            )
        return resp

    async def _values(self, buckets: list[WindowedBucket], now_ms: int) -> list[int]:
        """What each bucket holds now: counters (a sliding one with its previous window's
        share) and the live slots of concurrency limits."""
        counters = [b for b in buckets if b.kind != "concurrency"]
        keys = [b.key for b in counters] + [b.prev_key for b in counters if b.prev_key]
        read = dict(zip(keys, await self.gw.limiter.read(keys), strict=True))
        slots = [b.key for b in buckets if b.kind == "concurrency"]
        live = dict(zip(slots, await self.gw.limiter.count_slots(slots, now_ms), strict=True))
        out: list[int] = []
        for b in buckets:
            if b.kind == "concurrency":
                out.append(live[b.key])
                continue
            prev = read[b.prev_key] * b.prev_weight // SLIDING_SCALE if b.prev_key else 0
            out.append(read[b.key] + prev)
        return out


_UNITS = {"rpm": "requests", "tpm": "tokens", "concurrency": "requests"}


def add_usage_service(server: Any, gateway: Gateway) -> None:
    """Register the usage service on the ext_proc gRPC server."""
    usage_pb2_grpc.add_UsageServicer_to_server(UsageServicer(gateway), server)
