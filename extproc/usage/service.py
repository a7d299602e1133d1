"""``aiquota.v1.Usage`` served beside the ext_proc service: current counters of a tenant."""

from __future__ import annotations

from typing import Any

import grpc

from extproc._gen.aiquota.v1 import usage_pb2, usage_pb2_grpc
from extproc.access import USAGE_SERVICE, PortGuard
from extproc.config.load import key_digest
from extproc.core.admission_plan import format_amount
from extproc.core.keys import SLIDING_SCALE, WindowedBucket, slot_id, windowed
from extproc.core.levels import level_header
from extproc.core.rules import Limit
from extproc.errors import LimiterUnavailable
from extproc.gateway import Gateway


class UsageServicer(usage_pb2_grpc.UsageServicer):
    """Reads the counters of a tenant's buckets in their current windows.

    Who may read what (docs/security.md): the admin API's bearer token reads any tenant; a
    tenant's API key, sent as the bearer token or in the request's ``api_key``, reads that
    tenant only (another tenant id: PERMISSION_DENIED); anything else is UNAUTHENTICATED.
    Without a guard (or on a port served ``--insecure``) everyone is admin."""

    def __init__(self, gateway: Gateway, guard: PortGuard | None = None) -> None:
        self.gw = gateway
        self.guard = guard

    async def _authorise(self, request: Any, context: Any) -> None:
        """Abort the call unless its caller may read what it asks for."""
        if self.guard is None:
            return
        caller = self.guard.usage_caller(context)
        if caller.admin:
            return
        keys = self.gw.config.keys_by_digest
        own = caller.presented_key or request.api_key
        if not own:
            await self._refuse(
                context,
                "missing",
                grpc.StatusCode.UNAUTHENTICATED,
                "GetUsage needs the tenant's API key (bearer token or api_key) or the admin token",
            )
        key = keys.get(key_digest(own))
        if key is None:
            why = "wrong_token" if caller.presented_key else "unknown_key"
            await self._refuse(context, why, grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        assert key is not None
        asked = request.tenant
        if request.api_key and request.api_key != own:
            other = keys.get(key_digest(request.api_key))
            asked = other.tenant if other is not None else "?"
        if asked and asked != key.tenant:
            await self._refuse(
                context,
                "other_tenant",
                grpc.StatusCode.PERMISSION_DENIED,
                "an API key reads its own tenant's usage only",
            )
        tenant = self.gw.config.tenants.get(key.tenant)
        org = tenant.organisation if tenant is not None else ""
        team = tenant.team_of(key.name) if tenant is not None else ""
        if (request.organisation and request.organisation != org) or (
            request.team and request.team != team
        ):
            await self._refuse(
                context,
                "other_level",
                grpc.StatusCode.PERMISSION_DENIED,
                "an API key reads the levels it belongs to only (its organisation and team)",
            )

    async def _refuse(self, context: Any, reason: str, code: grpc.StatusCode, msg: str) -> None:
        assert self.guard is not None
        self.guard.note(context, USAGE_SERVICE, reason)
        await context.abort(code, msg)

    async def GetUsage(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Every bucket that applies to the tenant (and model, if given)."""
        await self._authorise(request, context)
        cfg = self.gw.config
        key_name = ""
        tenant_id = request.tenant
        if not request.api_key and not tenant_id and self.guard is not None:
            # a tenant's key as the bearer token, nothing in the request: that tenant
            presented = self.guard.usage_caller(context).presented_key
            key = cfg.keys_by_digest.get(key_digest(presented)) if presented else None
            if key is not None:
                key_name, tenant_id = key.name, key.tenant
        if request.api_key:
            key = cfg.keys_by_digest.get(key_digest(request.api_key))
            if key is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "unknown API key")
            assert key is not None
            key_name, tenant_id = key.name, key.tenant
        if not tenant_id and (request.organisation or request.team):
            return await self._level_usage(request, context)
        tenant = cfg.tenants.get(tenant_id)
        if tenant is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tenant {tenant_id!r}")
        assert tenant is not None
        team = tenant.team_of(key_name)
        if request.organisation and request.organisation != tenant.organisation:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tenant {tenant.id!r} is not in organisation {request.organisation!r}",
            )
        if request.team and request.team != team:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{'key' if key_name else 'tenant'} is not in team {request.team!r}",
            )
        # the tenant's, its key's and its levels' (organisation, team, and how many distinct
        # end users the team's window holds against its cap: a count, never the ids); an end
        # user's with end_user
        limits = tuple(
            lim for lim in tenant.limits_for(key_name) if request.end_user or lim.scope != "user"
        )
        if request.model:
            model = cfg.resolve_model(request.model)
            if model is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
            assert model is not None
            limits = tuple(lim for lim in limits if lim.applies_to(model.name))
        if not key_name:
            limits = tuple(lim for lim in limits if lim.scope != "key")
        resp = usage_pb2.GetUsageResponse(
            tenant=tenant.id,
            plan=tenant.plan,
            key_name=key_name,
            config_version=self.gw.config_version,
            organisation=tenant.organisation,
            team=team,
        )
        return await self._fill(
            resp,
            context,
            slot=tenant.slot,
            key_name=key_name,
            limits=limits,
            end_user=request.end_user,
            tenant_id=tenant.id,
        )

    async def _level_usage(self, request: Any, context: Any) -> Any:
        """An organisation's buckets and its teams', or a team's and its organisation's (with
        ``end_user``: that end user's in the team), without a tenant."""
        cfg = self.gw.config
        team = request.team
        org = request.organisation
        if team:
            found = cfg.organisation_of_team(team)
            if found is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown team {team!r}")
            if org and org != found:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"team {team!r} is not in organisation {org!r}",
                )
            org = found or ""
        elif org not in cfg.organisations:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown organisation {org!r}")
        teams = [team] if team else list(cfg.organisations.get(org, ()))
        limits = cfg.level_limits.get(("organisation", org), ()) + tuple(
            lim
            for t in teams
            for lim in cfg.level_limits.get(("team", t), ())
            if (request.end_user and team) or lim.scope != "user"
        )
        if request.model:
            model = cfg.resolve_model(request.model)
            if model is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
            assert model is not None
            limits = tuple(lim for lim in limits if lim.applies_to(model.name))
        resp = usage_pb2.GetUsageResponse(
            config_version=self.gw.config_version, organisation=org, team=team
        )
        return await self._fill(
            resp,
            context,
            slot=slot_id("", org),
            key_name="",
            limits=limits,
            end_user=request.end_user,
            tenant_id="",
        )

    async def _fill(
        self,
        resp: Any,
        context: Any,
        *,
        slot: str,
        key_name: str,
        limits: tuple[Limit, ...],
        end_user: str,
        tenant_id: str,
    ) -> Any:
        """``resp`` with the buckets of ``limits`` read now."""
        now = self.gw.clock.now_ms()
        buckets = windowed(self.gw.key_prefix, slot, key_name, limits, now, user=end_user)
        try:
            values = await self._values(buckets, now)
        except LimiterUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
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
                    level=(
                        f"key={tenant_id}/{key_name}"
                        if lim.scope == "key"
                        else level_header(b, tenant_id)
                    ),
                )
            )
        return resp

    async def _values(self, buckets: list[WindowedBucket], now_ms: int) -> list[int]:
        """What each bucket holds now: counters (a sliding one with its previous window's
        share), the live slots of concurrency limits and the size of a team's set of distinct
        end users (its members are never read)."""
        counters = [b for b in buckets if b.kind not in ("concurrency", "users")]
        keys = [b.key for b in counters] + [b.prev_key for b in counters if b.prev_key]
        read = dict(zip(keys, await self.gw.limiter.read(keys), strict=True))
        slots = [b.key for b in buckets if b.kind == "concurrency"]
        live = dict(zip(slots, await self.gw.limiter.count_slots(slots, now_ms), strict=True))
        sets = [b.key for b in buckets if b.kind == "users"]
        live |= dict(zip(sets, await self.gw.limiter.count_members(sets), strict=True))
        out: list[int] = []
        for b in buckets:
            if b.kind in ("concurrency", "users"):
                out.append(live[b.key])
                continue
            prev = read[b.prev_key] * b.prev_weight // SLIDING_SCALE if b.prev_key else 0
            out.append(read[b.key] + prev)
        return out


_UNITS = {"rpm": "requests", "tpm": "tokens", "concurrency": "requests", "users": "end users"}


def add_usage_service(server: Any, gateway: Gateway, guard: PortGuard | None = None) -> None:
    """Register the usage service on the ext_proc gRPC server (``guard``: who may read what)."""
    usage_pb2_grpc.add_UsageServicer_to_server(UsageServicer(gateway, guard), server)
