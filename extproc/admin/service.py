"""``aiquota.v1.Admin``: tenants and keys changed at run time, on a port of its own.

Authentication (``extproc.admin.auth``): a bearer token from ``--admin-token-file`` (read
again when the file changes) and/or client certificates (``--admin-tls-client-ca``).  The
server (:mod:`extproc.admin.server`) refuses to start on a non-loopback address without
credentials, and without TLS unless ``AIQ_ADMIN_ALLOW_PLAINTEXT`` says a proxy in front
terminates TLS.  On loopback credentials are optional (without them, anything on the machine
may call it: a warning is logged).

Every change is validated against the running rules file (a plan must be one of the file's,
limits must compile against its models and prices) before it is stored, together with its
audit entry (who, what, which version; ``ListChanges``).  Every call is counted in
``aiq_admin_calls_total{method,code}``.

This module only maps: each call onto the pure changes of :mod:`extproc.admin.changes` applied
through the store, their results onto messages, and their errors onto gRPC status codes.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc
from extproc.admin import changes
from extproc.admin.auth import Caller, TokenFile, caller
from extproc.admin.changes import (
    AdminError,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TenantView,
)
from extproc.admin.convert import limit_to_mapping, limit_to_message
from extproc.admin.rules import FileRules
from extproc.admin.state import StoredKey, StoreState
from extproc.admin.store import AdminStore, Conflict, StoreUnavailable
from extproc.admin.sync import StoreSync

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.admin")

__all__ = ["AdminServicer", "status_of"]

T = TypeVar("T")

#: The gRPC status of each refusal (the most specific class first).
_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (AdminError, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Conflict, grpc.StatusCode.ABORTED),
)


def status_of(exc: Exception) -> grpc.StatusCode:
    """The gRPC status a refused change or an unavailable store answers with."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    raise TypeError(f"no status for {type(exc).__name__}")


def _rpc(
    call: Callable[[AdminServicer, Any, Any], Awaitable[Any]],
) -> Callable[[AdminServicer, Any, Any], Awaitable[Any]]:
    """Answer a refusal (:class:`AdminError`) or a store failure with its gRPC status, and
    count the call in ``aiq_admin_calls_total{method,code}`` whatever its ending."""
    method = call.__name__

    @functools.wraps(call)
    async def answered(self: AdminServicer, request: Any, context: Any) -> Any:
        code = "OK"
        try:
            return await call(self, request, context)
        except (AdminError, StoreUnavailable, Conflict) as exc:
            status = status_of(exc)
            code = status.name
            await context.abort(status, str(exc))
            raise AssertionError("unreachable: abort raises") from exc
        except BaseException:
            status = context.code()
            code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
            raise
        finally:
            self.count(method, code)

    return answered


def _tenant_message(view: TenantView) -> Any:
    """A tenant view as an ``admin_pb2.Tenant``."""
    msg = admin_pb2.Tenant(
        tenant=view.tenant,
        plan=view.plan,
        source=view.source,
        organisation=view.organisation,
        team=view.team,
    )
    for lim in view.limits:
        msg.limits.append(limit_to_message(lim, admin_pb2.Limit))
    for k in view.keys:
        if k.source == "file":
            msg.keys.append(admin_pb2.KeyInfo(name=k.name, source=k.source, team=k.team))
        else:
            msg.keys.append(
                admin_pb2.KeyInfo(
                    key_id=k.key_id,
                    name=k.name,
                    source=k.source,
                    created_at=k.created_at,
                    expires_at=k.expires_at,
                    team=k.team,
                )
            )
    return msg


def level_mapping(request: Any) -> dict[str, Any]:
    """A ``SetLevelRequest`` as a rules-file organisation or team entry."""
    doc: dict[str, Any] = {"limits": [limit_to_mapping(m) for m in request.limits]}
    if request.strict:
        doc["charging"] = {"streaming": "strict"}
    if request.kind == "team":
        doc["organisation"] = request.organisation
        if request.end_user_limits:
            eu: dict[str, Any] = {"limits": [limit_to_mapping(m) for m in request.end_user_limits]}
            if request.max_end_users:
                eu["max_users"] = request.max_end_users
            if request.end_user_window:
                eu["per"] = request.end_user_window
            doc["end_users"] = eu
    elif request.organisation or request.end_user_limits:
        raise InvalidArgument("an organisation has no organisation nor end-user limits")
    return doc


def level_message(kind: str, name: str, entry: Any, source: str) -> Any:
    """An organisation or team entry as an ``admin_pb2.Level``."""
    msg = admin_pb2.Level(
        kind=kind, name=name, source=source, strict=entry.charging.streaming == "strict"
    )
    for lim in entry.limits:
        msg.limits.append(limit_to_message(lim, admin_pb2.Limit))
    if kind == "team":
        msg.organisation = entry.organisation
        if entry.end_users is not None:
            for lim in entry.end_users.limits:
                msg.end_user_limits.append(limit_to_message(lim, admin_pb2.Limit))
            msg.max_end_users = entry.end_users.max_users
            msg.end_user_window = entry.end_users.per
    return msg


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """The admin calls, over one store; validation against the replica's current rules."""

    def __init__(
        self,
        store: AdminStore,
        sync: StoreSync,
        *,
        now: Callable[[], float] = time.time,
        token: TokenFile | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.store, self.sync, self.now = store, sync, now
        self.token, self.metrics = token, metrics

    def count(self, method: str, code: str) -> None:
        """One admin call ended with ``code``."""
        if self.metrics is not None:
            self.metrics.admin_calls.labels(method, code).inc()

    def count_refused(self, method: str) -> None:
        """A call the token check refused."""
        self.count(method, "UNAUTHENTICATED")

    def _audit(
        self, context: Any, action: str, describe: Callable[[T], Mapping[str, Any]]
    ) -> Callable[[T], dict[str, str]]:
        """The audit entry of a change: the caller, the action and what ``describe`` says of
        the change's result (strings; ``detail`` as JSON)."""
        who: Caller = caller(context, self.token)

        def entry(result: T) -> dict[str, str]:
            out = {
                "action": action,
                "principal": who.principal,
                "on_behalf_of": who.on_behalf_of,
                "peer": who.peer,
            }
            for name, value in describe(result).items():
                out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            log.info("admin_audit", **out)
            return out

        return entry

    @property
    def rules(self) -> FileRules:
        """The rules file this replica runs on."""
        return self.sync.rules

    # -- keys ---------------------------------------------------------------------------

    @_rpc
    async def CreateKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """A new key for a tenant; its plaintext is in this answer only."""
        tenant, name = request.tenant, request.name
        changes.check_id(tenant, "tenant")
        changes.check_key_name(name)
        if request.team:
            changes.check_id(request.team, "team")
        secret = changes.new_secret()
        key = StoredKey(
            changes.new_key_id(),
            name,
            tenant,
            changes.digest(secret),
            self.now(),
            team=request.team,
        )

        def change(state: StoreState) -> tuple[StoreState, None]:
            return changes.create_key(state, self.rules, key, self.now())

        audit = self._audit(
            context, "create_key", lambda _r: {"tenant": tenant, "key": name, "key_id": key.id}
        )
        stored, _ = await self.store.update(change, audit=audit)
        log.info(
            "admin_key_created", tenant=tenant, key=name, key_id=key.id, version=stored.version
        )
        return admin_pb2.CreateKeyResponse(
            tenant=tenant, name=name, key_id=key.id, api_key=secret, version=stored.version
        )

    @_rpc
    async def RotateKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """A new secret under the same name; the old one ends now or after the grace."""
        grace = request.grace_seconds
        changes.check_grace(grace)
        secret = changes.new_secret()
        now = self.now()
        new_id = changes.new_key_id()

        def change(state: StoreState) -> tuple[StoreState, tuple[StoredKey, StoredKey]]:
            return changes.rotate_key(
                state,
                request.key_id,
                new_id=new_id,
                new_digest=changes.digest(secret),
                grace=grace,
                now=now,
            )

        def describe(pair: tuple[StoredKey, StoredKey]) -> dict[str, Any]:
            replaced = {"replaces": pair[0].id, "grace_seconds": grace}
            return {**changes.key_fields(pair[1]), "detail": replaced}

        audit = self._audit(context, "rotate_key", describe)
        stored, (old, new) = await self.store.update(change, audit=audit)
        ends = stored.keys[old.id].expires_at if old.id in stored.keys else now
        log.info(
            "admin_key_rotated",
            tenant=new.tenant,
            key=new.name,
            key_id=new.id,
            revoked_key_id=old.id,
            grace_s=grace,
            version=stored.version,
        )
        return admin_pb2.CreateKeyResponse(
            tenant=new.tenant,
            name=new.name,
            key_id=new.id,
            api_key=secret,
            version=stored.version,
            revoked_key_id=old.id,
            old_key_expires_at=ends or now,
        )

    @_rpc
    async def RevokeKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """The key stops working on every replica (within a second)."""

        def change(state: StoreState) -> tuple[StoreState, StoredKey]:
            return changes.revoke_key(state, request.key_id)

        audit = self._audit(context, "revoke_key", changes.key_fields)
        stored, key = await self.store.update(change, audit=audit)
        log.info("admin_key_revoked", **changes.key_fields(key), version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    @_rpc
    async def SetKeyTeam(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Move a store key to another team (docs/semantics.md, "Levels")."""

        def change(state: StoreState) -> tuple[StoreState, StoredKey]:
            return changes.set_key_team(state, self.rules, request.key_id, request.team, self.now())

        audit = self._audit(context, "set_key_team", changes.key_team_fields)
        stored, key = await self.store.update(change, audit=audit)
        log.info("admin_key_team_set", **changes.key_team_fields(key), version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    # -- tenants ------------------------------------------------------------------------

    @_rpc
    async def SetTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Create a tenant, or replace its plan and limit overrides."""
        tid = request.tenant
        limits = [limit_to_mapping(m) for m in request.limits]
        tenant = changes.new_tenant(
            self.rules,
            tid,
            request.plan,
            limits,
            self.now(),
            organisation=request.organisation,
            team=request.team,
        )

        def change(state: StoreState) -> tuple[StoreState, bool]:
            return changes.set_tenant(state, tid, tenant, self.rules, self.now())

        levels = {
            k: v for k, v in (("organisation", tenant.organisation), ("team", tenant.team)) if v
        }
        audit = self._audit(
            context,
            "set_tenant",
            lambda replaced: {
                "tenant": tid,
                "detail": {
                    "plan": tenant.plan,
                    "limits": limits,
                    "replaced": replaced,
                    **levels,
                },
            },
        )
        stored, _ = await self.store.update(change, audit=audit)
        log.info(
            "admin_tenant_set",
            tenant=tid,
            plan=tenant.plan,
            limits=len(tenant.limits),
            version=stored.version,
        )
        return admin_pb2.ChangeResponse(version=stored.version)

    @_rpc
    async def DeleteTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Remove a tenant's store entry and its store keys (a tenant the rules file also
        defines goes back to the file's plan, limits and keys)."""
        tid = request.tenant

        def change(state: StoreState) -> tuple[StoreState, int]:
            return changes.delete_tenant(state, self.rules, tid)

        audit = self._audit(
            context, "delete_tenant", lambda n: {"tenant": tid, "detail": {"keys_removed": n}}
        )
        stored, removed = await self.store.update(change, audit=audit)
        log.info("admin_tenant_deleted", tenant=tid, keys_removed=removed, version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    # -- levels -------------------------------------------------------------------------

    @_rpc
    async def SetLevel(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Create or replace an organisation or a team (docs/semantics.md, "Levels")."""
        kind, name = request.kind, request.name
        doc = level_mapping(request)
        entry = changes.new_level(kind, name, doc)
        now = self.now()

        def change(state: StoreState) -> tuple[StoreState, bool]:
            return changes.set_level(state, self.rules, kind, name, entry=entry, now=now)

        audit = self._audit(
            context,
            "set_level",
            lambda replaced: {"detail": {"kind": kind, "name": name, **doc, "replaced": replaced}},
        )
        stored, _ = await self.store.update(change, audit=audit)
        log.info("admin_level_set", kind=kind, name=name, version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    @_rpc
    async def DeleteLevel(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Remove a stored organisation or team (refused while anything is in it)."""
        kind, name = request.kind, request.name
        if kind not in changes.LEVEL_KINDS:
            raise InvalidArgument(f"kind {kind!r}: 'organisation' or 'team'")
        now = self.now()

        def change(state: StoreState) -> tuple[StoreState, None]:
            return changes.delete_level(state, self.rules, kind, name, now)

        audit = self._audit(
            context, "delete_level", lambda _r: {"detail": {"kind": kind, "name": name}}
        )
        stored, _ = await self.store.update(change, audit=audit)
        log.info("admin_level_deleted", kind=kind, name=name, version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    @_rpc
    async def ListLevels(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Every organisation and team in force: the store's over the file's."""
        state = await self.store.load()
        file_doc = self.rules.document
        out = admin_pb2.ListLevelsResponse(version=state.version)
        for name in sorted(set(file_doc.organisations) | set(state.organisations)):
            org = state.organisations.get(name) or file_doc.organisations[name]
            source = "store" if name in state.organisations else "file"
            out.levels.append(level_message("organisation", name, org, source))
        for name in sorted(set(file_doc.teams) | set(state.teams)):
            team = state.teams.get(name) or file_doc.teams[name]
            source = "store" if name in state.teams else "file"
            out.levels.append(level_message("team", name, team, source))
        return out

    @_rpc
    async def ListTenants(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Every tenant: the file's and the store's."""
        state = await self.store.load()
        rules, now = self.rules, self.now()
        return admin_pb2.ListTenantsResponse(
            tenants=[
                _tenant_message(changes.tenant_view(state, rules, tid, now))
                for tid in changes.tenant_ids(state, rules)
            ],
            version=state.version,
        )

    @_rpc
    async def GetTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """One tenant: plan, limits, key names and ids (never digests or secrets)."""
        state = await self.store.load()
        changes.known_tenant(state, self.rules, request.tenant)
        return _tenant_message(changes.tenant_view(state, self.rules, request.tenant, self.now()))

    @_rpc
    async def GetVersion(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """The store's version, and the rules this replica runs on."""
        try:
            store_version = await self.store.version()
        except StoreUnavailable:
            store_version = -1
        return admin_pb2.VersionResponse(
            store_version=store_version,
            applied_version=self.sync.state.version,
            config_version=self.sync.current.version,
            file_version=self.rules.version,
        )

    @_rpc
    async def ListChanges(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """The audit log: the newest changes (``limit``, default 100, at most 1,000) after
        ``since_version``, oldest first."""
        count = changes.changes_count(request.limit)
        rows = await self.store.audit_log(since_version=request.since_version, count=count)
        out = admin_pb2.ListChangesResponse()
        for row in rows:
            f = row.fields
            out.changes.append(
                admin_pb2.Change(
                    version=row.version,
                    at_ms=row.at_ms,
                    action=f.get("action", ""),
                    principal=f.get("principal", ""),
                    on_behalf_of=f.get("on_behalf_of", ""),
                    peer=f.get("peer", ""),
                    tenant=f.get("tenant", ""),
                    key=f.get("key", ""),
                    key_id=f.get("key_id", ""),
                    detail=f.get("detail", ""),
                )
            )
        return out
