"""``aiquota.v1.Admin``: tenants and keys changed at run time, on a port of its own.

Authentication: every call carries ``authorization: Bearer <token>``, compared in constant
time with the token read from ``--admin-token-file`` (a wrong or missing one is
UNAUTHENTICATED).  The server refuses to start on a non-loopback address without a token file,
and without TLS (``--admin-tls-cert``/``--admin-tls-key``) unless
``AIQ_ADMIN_ALLOW_PLAINTEXT`` says a proxy in front terminates TLS.  On loopback a token file
is optional (without one, anything on the machine may call it: a warning is logged).

Every change is validated against the running rules file (a plan must be one of the file's,
limits must compile against its models and prices) before it is stored.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

from extproc._gen.aiquota.v1 import admin_pb2, admin_pb2_grpc
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


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """The admin calls, over one store; validation against the replica's current rules."""

    def __init__(
        self, store: AdminStore, sync: StoreSync, *, now: Callable[[], float] = time.time
    ) -> None:
        self.store, self.sync, self.now = store, sync, now

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

        stored, _ = await self._run(context, lambda: self.store.update(change))
        log.info(
            "admin_key_created", tenant=tenant, key=name, key_id=key.id, version=stored.version
        )
        return admin_pb2.CreateKeyResponse(
            tenant=tenant, name=name, key_id=key.id, api_key=secret, version=stored.version
        )

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

        stored, (old, new) = await self._run(context, lambda: self.store.update(change))
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

    async def RevokeKey(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """The key stops working on every replica (within a second)."""

        def change(state: StoreState) -> tuple[StoreState, StoredKey]:
            key = state.keys.get(request.key_id)
            if key is None:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown key id {request.key_id!r}")
            keys = {k: v for k, v in state.keys.items() if k != key.id}
            return replace(state, keys=keys), key

        stored, key = await self._run(context, lambda: self.store.update(change))
        log.info(
            "admin_key_revoked",
            tenant=key.tenant,
            key=key.name,
            key_id=key.id,
            version=stored.version,
        )
        return admin_pb2.ChangeResponse(version=stored.version)

    # -- tenants ------------------------------------------------------------------------

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

        def change(state: StoreState) -> tuple[StoreState, None]:
            return replace(state, tenants={**state.tenants, tid: tenant}), None

        stored, _ = await self._run(context, lambda: self.store.update(change))
        log.info(
            "admin_tenant_set",
            tenant=tid,
            plan=tenant.plan,
            limits=len(limits),
            version=stored.version,
        )
        return admin_pb2.ChangeResponse(version=stored.version)

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

        stored, removed = await self._run(context, lambda: self.store.update(change))
        log.info("admin_tenant_deleted", tenant=tid, keys_removed=removed, version=stored.version)
        return admin_pb2.ChangeResponse(version=stored.version)

    async def ListTenants(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """Every tenant: the file's and the store's."""
        state = await self._run(context, self.store.load)
        names = set(self.rules.document.tenants) | set(state.tenants)
        names |= {k.tenant for k in state.keys.values()}
        return admin_pb2.ListTenantsResponse(
            tenants=[self._view(tid, state) for tid in sorted(names)], version=state.version
        )

    async def GetTenant(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        """One tenant: plan, limits, key names and ids (never digests or secrets)."""
        state = await self._run(context, self.store.load)
        tid = request.tenant
        known = self._in_file(tid) or tid in state.tenants
        if not known and not any(k.tenant == tid for k in state.keys.values()):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tenant {tid!r}")
        return self._view(tid, state)

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


class BearerAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = hashlib.sha256(token.encode()).digest()
        self._deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    def allows(self, metadata: Any) -> bool:
        """Whether the call's metadata carries the token (constant-time comparison)."""
        presented = ""
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str):
                presented = value
        scheme, _, token = presented.partition(" ")
        if scheme.lower() != "bearer":
            token = ""
        given = hashlib.sha256(token.strip().encode()).digest()
        return hmac.compare_digest(given, self._expected) and bool(token)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        """Pass an authenticated call on; answer any other with UNAUTHENTICATED."""
        if self.allows(details.invocation_metadata):
            return await continuation(details)
        log.warning("admin_unauthenticated", method=details.method)
        return self._deny


async def _unauthenticated(request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin bearer token")


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped); refused when empty."""
    p = Path(path)
    try:
        token = p.read_text(encoding="utf-8").strip()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminConfigError(f"admin token file {path}: {exc}") from exc
    if not token:
        raise AdminConfigError(f"admin token file {path} is empty")
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("admin_token_file_readable_by_others", path=path, mode=oct(mode & 0o777))
    return token


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (``localhost``, 127/8, ``::1``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_listen(host: str, *, token: str | None, tls: bool, allow_plaintext: bool = False) -> None:
    """Refuse an admin listener that anyone on the network could use or sniff."""
    if is_loopback(host):
        if token is None:
            log.warning(
                "admin_unauthenticated_on_loopback",
                host=host,
                note="anything on this machine may call the admin API; set --admin-token-file",
            )
        return
    if token is None:
        raise AdminConfigError(
            f"the admin API on non-loopback address {host!r} needs a bearer token "
            "(--admin-token-file or AIQ_ADMIN_TOKEN_FILE)"
        )
    if not tls and not allow_plaintext:
        raise AdminConfigError(
            f"the admin API on non-loopback address {host!r} would send its token in plaintext: "
            "give --admin-tls-cert and --admin-tls-key (or set AIQ_ADMIN_ALLOW_PLAINTEXT=1 when "
            "a proxy in front terminates TLS)"
        )


def _server_credentials(cert: str, key: str) -> Any:
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    except OSError as exc:
        raise AdminConfigError(f"admin TLS: {exc}") from exc
    return grpc.ssl_server_credentials([pair])


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
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    allow_plaintext: bool = False,
    reuse_port: bool = False,
) -> AdminServer:
    """Check the listener is safe (:class:`AdminConfigError`), then serve ``servicer``."""
    if bool(tls_cert) != bool(tls_key):
        raise AdminConfigError("--admin-tls-cert and --admin-tls-key go together")
    check_listen(host, token=token, tls=bool(tls_cert), allow_plaintext=allow_plaintext)
    interceptors = [BearerAuth(token)] if token is not None else []
    server = grpc.aio.server(
        interceptors=interceptors, options=[("grpc.so_reuseport", 1 if reuse_port else 0)]
    )
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if tls_cert and tls_key:
        creds = _server_credentials(tls_cert, tls_key)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address} for the admin API (address in use?)")
    await server.start()
    log.info("admin_serving", address=address, port=bound, tls=bool(tls_cert), auth=bool(token))
    return AdminServer(server, bound, address)
