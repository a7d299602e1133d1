"""``aiquota.v1.Admin``: tenants and keys changed at run time, on a port of its own.

Authentication (``extproc.admin.auth``): a bearer token from ``--admin-token-file`` (read
again when the file changes) and/or client certificates (``--admin-tls-client-ca``).  The
server refuses to start on a non-loopback address without credentials, and without TLS unless
``AIQ_ADMIN_ALLOW_PLAINTEXT`` says a proxy in front terminates TLS.  On loopback credentials
are optional (without them, anything on the machine may call it: a warning is logged).

Every change is validated against the running rules file (a plan must be one of the file's,
limits must compile against its models and prices) before it is stored, together with its
audit entry (who, what, which version; ``ListChanges``).  Every call is counted in
``aiq_admin_calls_total{method,code}``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc
from extproc.admin.auth import (
    BearerAuth,
    Caller,
    TokenFile,
    caller,
    check_listen,
    server_credentials,
)
from extproc.admin.convert import limit_to_mapping, limit_to_message
from extproc.admin.errors import AdminConfigError
from extproc.admin.rules import FileRules, tenant_errors
from extproc.admin.state import (
    KEY_NAME,
    TENANT_ID,
    StateError,
    StoredKey,
    StoredTenant,
    StoreState,
    parse_limits,
)
from extproc.admin.store import AdminStore, Conflict, StoreUnavailable
from extproc.admin.sync import StoreSync

if TYPE_CHECKING:
    from extproc.metrics import Metrics

log = structlog.get_logger("extproc.admin")

__all__ = ["AdminConfigError", "AdminServer", "AdminServicer", "start_admin_server"]

T = TypeVar("T")

#: The longest grace a rotated key may keep working for.
MAX_GRACE_S = 30 * 24 * 3600
#: Prefix of the secrets the store issues (recognisable in a leak scanner).
KEY_PREFIX = "sk-aiq-"


class Refused(Exception):
    """A call refused with a gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def new_secret() -> str:
    """A fresh API key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    """A key id (safe to show and log)."""
    return "key_" + secrets.token_hex(8)


def digest(secret: str) -> str:
    """What is stored of a secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _counted(
    call: Callable[[AdminServicer, Any, Any], Awaitable[Any]],
) -> Callable[[AdminServicer, Any, Any], Awaitable[Any]]:
    """Count the call in ``aiq_admin_calls_total{method,code}`` whatever its ending."""
    method = call.__name__

    @functools.wraps(call)
    async def counted(self: AdminServicer, request: Any, context: Any) -> Any:
        code = "OK"
        try:
            return await call(self, request, context)
        except BaseException:
            status = context.code()
            code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
            raise
        finally:
            self.count(method, code)

    return counted


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

    async def _run(self, context: Any, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Conflict as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        raise AssertionError("unreachable: abort raises")

    # -- keys ---------------------------------------------------------------------------

    @_counted
    async def CreateKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """A new key for a tenant; its plaintext is in this answer only."""
        tenant, name = request.tenant, request.name
        _check_id(tenant, "tenant")
        _check_key_name(name)
        secret = new_secret()
        key = StoredKey(new_key_id(), name, tenant, digest(secret), self.now())

        def change(state: StoreState) -> tuple[StoreState, None]:
            if tenant not in self.rules.document.tenants and tenant not in state.tenants:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown tenant {tenant!r}")
            if name in self._key_names(state, tenant):
                raise Refused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"tenant {tenant!r} already has a key named {name!r} (rotate it instead)",
                )
            return replace(state, keys={**state.keys, key.id: key}), None

        audit = self._audit(
            context, "create_key", lambda _r: {"tenant": tenant, "key": name, "key_id": key.id}
        )
        stored, _ = await self._run(context, lambda: self.store.update(change, audit=audit))
        log.info(
            "admin_key_created", tenant=tenant, key=name, key_id=key.id, version=stored.version
        )
        return admin_pb2.CreateKeyResponse(
            tenant=tenant, name=name, key_id=key.id, api_key=secret, version=stored.version
        )

    @_counted
    async def RotateKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """A new secret under the same name; the old one ends now or after the grace."""
        grace = request.grace_seconds
        if not 0 <= grace <= MAX_GRACE_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"grace_seconds must be between 0 and {MAX_GRACE_S}",
            )
        secret = new_secret()
        now = self.now()

        def change(state: StoreState) -> tuple[StoreState, tuple[StoredKey, StoredKey]]:
            old = self._active_key(state, request.key_id)
            new = StoredKey(new_key_id(), old.name, old.tenant, digest(secret), now)
            keys = {k: v for k, v in state.keys.items() if k != old.id}
            if grace > 0:
                ends = now + grace if old.expires_at is None else min(old.expires_at, now + grace)
                keys[old.id] = replace(old, expires_at=ends)
            keys[new.id] = new
            return replace(state, keys=keys), (old, new)

        def describe(pair: tuple[StoredKey, StoredKey]) -> dict[str, Any]:
            replaced = {"replaces": pair[0].id, "grace_seconds": grace}
            return {**_key_fields(pair[1]), "detail": replaced}

        audit = self._audit(context, "rotate_key", describe)
        stored, (old, new) = await self._run(
            context, lambda: self.store.update(change, audit=audit)
        )
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

    @_counted
    async def RevokeKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """The key stops working on every replica (within a second)."""

        def change(state: StoreState) -> tuple[StoreState, StoredKey]:
            key = state.keys.get(request.key_id)
            if key is None:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown key id {request.key_id!r}")
            keys = {k: v for k, v in state.keys.items() if k != key.id}
            return replace(state, keys=keys), key

        audit = self._audit(context, "revoke_key", _key_fields)
        stored, key = await self._run(context, lambda: self.store.update(change, audit=audit))
        log.info(
            "admin_key_revoked",
            tenant=key.tenant,
            key=key.name,
            key_id=key.id,
            version=stored.version,
        )
        return admin_pb2.ChangeResponse(version=stored.version)

    # -- tenants ------------------------------------------------------------------------

    @_counted
    async def SetTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Create a tenant, or replace its plan and limit overrides."""
        tid = request.tenant
        try:
            _check_id(tid, "tenant")
            limits = tuple(parse_limits([limit_to_mapping(m) for m in request.limits]))
        except (Refused, StateError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tenant = StoredTenant(plan=request.plan, limits=limits, updated_at=self.now())
        errors = tenant_errors(self.rules, tid, tenant)
        if errors:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"tenant {tid!r}: " + "; ".join(errors)
            )

        def change(state: StoreState) -> tuple[StoreState, bool]:
            return replace(state, tenants={**state.tenants, tid: tenant}), tid in state.tenants

        audit = self._audit(
            context,
            "set_tenant",
            lambda replaced: {
                "tenant": tid,
                "detail": {
                    "plan": tenant.plan,
                    "limits": [limit_to_mapping(m) for m in request.limits],
                    "replaced": replaced,
                },
            },
        )
        stored, _ = await self._run(context, lambda: self.store.update(change, audit=audit))
        log.info(
            "admin_tenant_set",
            tenant=tid,
            plan=tenant.plan,
            limits=len(limits),
            version=stored.version,
        )
        return admin_pb2.ChangeResponse(version=stored.version)

    @_counted
    async def DeleteTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Remove a tenant's store entry and its store keys (a tenant the rules file also
        defines goes back to the file's plan, limits and keys)."""
        tid = request.tenant

        def change(state: StoreState) -> tuple[StoreState, int]:
            keys = {k: v for k, v in state.keys.items() if v.tenant != tid}
            if tid not in state.tenants and len(keys) == len(state.keys):
                raise Refused(
                    grpc.StatusCode.NOT_FOUND,
                    f"the store holds nothing for tenant {tid!r}"
                    + (" (it is defined in the rules file)" if self._in_file(tid) else ""),
                )
            tenants = {k: v for k, v in state.tenants.items() if k != tid}
            return StoreState(state.version, tenants, keys), len(state.keys) - len(keys)

        audit = self._audit(
            context, "delete_tenant", lambda n: {"tenant": tid, "detail": {"keys_removed": n}}
        )
        stored, removed = await self._run(context, lambda: self.store.update(change, audit=audit))
        log.info("admin_tenant_deleted", tenant=tid, keys_removed=removed, version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    @_counted
    async def ListTenants(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Every tenant: the file's and the store's."""
        state = await self._run(context, self.store.load)
        names = set(self.rules.document.tenants) | set(state.tenants)
        names |= {k.tenant for k in state.keys.values()}
        return admin_pb2.ListTenantsResponse(
            tenants=[self._view(tid, state) for tid in sorted(names)], version=state.version
        )

    @_counted
    async def GetTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """One tenant: plan, limits, key names and ids (never digests or secrets)."""
        state = await self._run(context, self.store.load)
        tid = request.tenant
        known = self._in_file(tid) or tid in state.tenants
        if not known and not any(k.tenant == tid for k in state.keys.values()):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tenant {tid!r}")
        return self._view(tid, state)

    @_counted
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

    @_counted
    async def ListChanges(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """The audit log: the newest changes (``limit``, default 100, at most 1,000) after
        ``since_version``, oldest first."""
        limit = request.limit or 100
        if not 0 < limit <= 1000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: 1 to 1000")
        rows = await self._run(
            context, lambda: self.store.audit_log(since_version=request.since_version, count=limit)
        )
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

    # -- helpers --------------------------------------------------------------------------

    def _in_file(self, tid: str) -> bool:
        return tid in self.rules.document.tenants

    def _key_names(self, state: StoreState, tenant: str) -> set[str]:
        now = self.now()
        names = {k.name for k in state.keys.values() if k.tenant == tenant and k.active(now)}
        file_tenant = self.rules.document.tenants.get(tenant)
        if file_tenant is not None:
            names |= {k.name for k in file_tenant.keys}
        return names

    def _active_key(self, state: StoreState, key_id: str) -> StoredKey:
        key = state.keys.get(key_id)
        if key is None or not key.active(self.now()):
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown key id {key_id!r}")
        if key.expires_at is not None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"key {key_id!r} was already rotated (it expires); rotate its successor",
            )
        return key

    def _view(self, tid: str, state: StoreState) -> Any:
        file_t = self.rules.document.tenants.get(tid)
        store_t = state.tenants.get(tid)
        source = "store+file" if store_t and file_t else "store" if store_t else "file"
        if store_t is None and file_t is None:
            source = "store"  # keys only, of a tenant neither defines (not in force)
        plan = store_t.plan if store_t else file_t.plan if file_t else ""
        limits = store_t.limits if store_t else tuple(file_t.limits) if file_t else ()
        msg = admin_pb2.Tenant(tenant=tid, plan=plan, source=source)
        for lim in limits:
            msg.limits.append(limit_to_message(lim, admin_pb2.Limit))
        if file_t is not None:
            for fk in file_t.keys:
                msg.keys.append(admin_pb2.KeyInfo(name=fk.name, source="file"))
        now = self.now()
        for k in sorted(state.keys.values(), key=lambda k: (k.created_at, k.id)):
            if k.tenant == tid and k.active(now):
                msg.keys.append(
                    admin_pb2.KeyInfo(
                        key_id=k.id,
                        name=k.name,
                        source="store",
                        created_at=k.created_at,
                        expires_at=k.expires_at or 0.0,
                    )
                )
        return msg


def _key_fields(key: StoredKey) -> dict[str, Any]:
    """What the audit log says of a key (never its digest)."""
    return {"tenant": key.tenant, "key": key.name, "key_id": key.id}


def _check_id(value: str, what: str) -> None:
    if not TENANT_ID.match(value):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} {value!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit",
        )


def _check_key_name(value: str) -> None:
    if not KEY_NAME.match(value):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"key name {value!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit",
        )


# -- the server ---------------------------------------------------------------------------


@dataclass
class AdminServer:
    """A started admin gRPC server."""

    server: Any
    port: int
    address: str

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (calls in flight get ``grace`` seconds)."""
        await self.server.stop(grace)


async def start_admin_server(
    servicer: AdminServicer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: TokenFile | str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    allow_plaintext: bool = False,
    reuse_port: bool = False,
) -> AdminServer:
    """Check the listener is safe (:class:`AdminConfigError`), then serve ``servicer``.
    ``token``: the token file (or, in tests, the token itself)."""
    if bool(tls_cert) != bool(tls_key):
        raise AdminConfigError("--admin-tls-cert and --admin-tls-key go together")
    check_listen(
        host,
        token=token is not None,
        tls=bool(tls_cert),
        client_certs=bool(tls_client_ca),
        allow_plaintext=allow_plaintext,
    )
    if isinstance(token, str):
        token = TokenFile.fixed(token)
    servicer.token = token
    interceptors = [BearerAuth(token, servicer.count_refused)] if token is not None else []
    server = grpc.aio.server(
        interceptors=interceptors, options=[("grpc.so_reuseport", 1 if reuse_port else 0)]
    )
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if tls_cert and tls_key:
        creds = server_credentials(tls_cert, tls_key, tls_client_ca)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address} for the admin API (address in use?)")
    await server.start()
    log.info(
        "admin_serving",
        address=address,
        port=bound,
        tls=bool(tls_cert),
        token=token is not None,
        client_certs=bool(tls_client_ca),
    )
    return AdminServer(server, bound, address)
