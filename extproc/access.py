"""Who may call which service on the gateway's gRPC port (docs/security.md).

One boundary for the whole port, :class:`PortGuard`:

* ``grpc.health.v1.Health`` stays open (Envoy's active health check, probes);
* ``aiquota.v1.Usage`` is authorised by the servicer through :meth:`PortGuard.usage_caller`,
  because who may read what depends on the request: a tenant's own API key reads that tenant
  only, the admin API's bearer token reads any tenant;
* every other service (ext_proc, the RLS API, anything registered later) answers only a
  *caller credential*: a bearer token from the caller token file (``authorization: Bearer
  <token>`` metadata, which Envoy sends as its ``grpc_service``'s ``initial_metadata``) or a
  client certificate signed by the configured CA whose SAN is on the allowed list (mutual TLS).

The token file (:mod:`extproc.caller_tokens`) holds one token per line, so two tokens are
valid at once during a rotation; it is read again when it changed.  A refused call is answered ``UNAUTHENTICATED`` (no or a wrong credential) or
``PERMISSION_DENIED`` (a good credential asking for what it may not), counted in
``aiq_grpc_refused_total{service, reason}`` and logged at most once a minute per peer host.

TLS for the port (:func:`server_credentials`) uses grpc's dynamic certificate configuration:
the certificate, key and client CA files are checked at each new connection's handshake and
loaded again when they changed, so a renewed certificate needs no restart.
"""

from __future__ import annotations

import inspect
import os
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from extproc.admin.auth import is_loopback
from extproc.caller_tokens import AccessConfigError, TokenSet

log = structlog.get_logger("extproc.access")

HEALTH_SERVICE = "grpc.health.v1.Health"
USAGE_SERVICE = "aiquota.v1.Usage"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"

#: The ``service`` label of the refusal metric: the port's services, anything else folded.
SERVICE_LABELS = {EXT_PROC_SERVICE: "ext_proc", RLS_SERVICE: "rls", USAGE_SERVICE: "usage"}
#: The ``reason`` label: a fixed set.
REASONS = (
    "missing",  # no credential at all
    "wrong_token",  # a bearer token that is not in force
    "san_not_allowed",  # a client certificate whose SAN is not on the list
    "unknown_key",  # usage: an API key no tenant has
    "other_tenant",  # usage: a tenant's key asking for another tenant
)

#: How often one peer's refusals are logged (the metric counts every one).
LOG_EVERY_S = 60.0
#: Peers remembered for the log limit; beyond it the oldest entries are forgotten.
_MAX_PEERS = 4096


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token of an ``authorization: Bearer <token>`` entry ("" when there is none)."""
    presented = ""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            presented = value
    scheme, _, token = presented.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.7:53412`` -> ``10.0.0.7`` (a reconnecting client is the same peer)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        rest = rest.rsplit(":", 1)[0]
        return rest.strip("[]").removeprefix("%5B").removesuffix("%5D")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer or "?"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def cert_names(context: Any) -> list[str]:
    """The SANs (or, when it has none, the common name) of the peer's verified certificate."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # a context without TLS information
        return []
    names = [_text(v) for v in auth.get("x509_subject_alternative_name") or ()]
    if not names:
        names = [_text(v) for v in auth.get("x509_common_name") or ()]
    return names


@dataclass(frozen=True)
class UsageCaller:
    """Who asks the usage API: an admin (any tenant) or the tenant a key belongs to."""

    admin: bool
    presented_key: str = ""  # the API key sent as the bearer token ("" when none)


class PortGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The gRPC port's credential checks (see the module docstring).

    ``open_port``: no caller credential is configured and the operator asked for that
    (``--insecure``): every call passes, as before credentials existed."""

    def __init__(
        self,
        *,
        tokens: TokenSet | None = None,
        client_certs: bool = False,
        allowed_sans: Iterable[str] = (),
        admin_token: Any = None,  # extproc.admin.auth.TokenFile: the usage API's admin
        refused: Any = None,  # a prometheus Counter with labels (service, reason)
        open_port: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokens = tokens
        self.client_certs = client_certs
        self.allowed_sans = frozenset(s.strip() for s in allowed_sans if s.strip())
        self.admin_token = admin_token
        self.refused = refused
        self.open_port = open_port
        self._clock = clock
        self._logged: dict[str, float] = {}

    # -- the interceptor ---------------------------------------------------------------------
    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        """Health and usage pass (usage checks in its servicer); any other call needs the
        caller credential: a token decides here, a client certificate in the handler (the
        certificate is only visible on the call's context)."""
        service = details.method[1:].rsplit("/", 1)[0]
        if self.open_port or service in (HEALTH_SERVICE, USAGE_SERVICE):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED
            return None
        if self.tokens is not None:
            presented = bearer(details.invocation_metadata)
            if presented and self.tokens.matches(presented):
                return handler
            if presented and not self.client_certs:
                return self._deny(handler, service, "wrong_token", "wrong bearer token")
        if not self.client_certs:
            return self._deny(handler, service, "missing", "a caller credential is required")
        return self._wrap(handler, service)

    def _deny(self, handler: Any, service: str, reason: str, message: str) -> Any:
        """A handler of the method's own shape that refuses the call before reading it."""

        async def check(context: Any) -> None:
            self.note(context, service, reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return _guarded(handler, check, call=False)

    def _cert_allowed(self, context: Any) -> str:
        """The refusal reason for the peer's certificate; empty when it may call."""
        names = cert_names(context)
        if not names:
            return "missing"
        if self.allowed_sans and not self.allowed_sans.intersection(names):
            return "san_not_allowed"
        return ""

    def _wrap(self, handler: Any, service: str) -> Any:
        """``handler`` behind the client-certificate check (mutual TLS callers)."""

        async def check(context: Any) -> None:
            reason = self._cert_allowed(context)
            if reason:
                self.note(context, service, reason)
                missing = reason == "missing"
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED
                    if missing
                    else grpc.StatusCode.PERMISSION_DENIED,
                    "a caller credential is required"
                    if missing
                    else "this client certificate may not call this service",
                )

        return _guarded(handler, check, call=True)

    # -- the usage API -----------------------------------------------------------------------
    def usage_caller(self, context: Any) -> UsageCaller:
        """Who asks the usage API: the admin token makes an admin; any other bearer token is
        taken for an API key (the servicer checks it); on an open port, everyone is admin."""
        if self.open_port:
            return UsageCaller(admin=True)
        presented = bearer(context.invocation_metadata())
        if presented and self.admin_token is not None and self.admin_token.matches(presented):
            return UsageCaller(admin=True)
        return UsageCaller(admin=False, presented_key=presented)

    # -- refusals: counted, logged at most once a minute per peer ----------------------------
    def note(self, context: Any, service: str, reason: str) -> None:
        """Count a refusal and log it unless this peer was logged within a minute."""
        label = SERVICE_LABELS.get(service, "other")
        if self.refused is not None:
            self.refused.labels(label, reason if reason in REASONS else "other").inc()
        try:
            peer = peer_host(str(context.peer() or ""))
        except Exception:
            peer = "?"
        now = self._clock()
        last = self._logged.get(peer)
        if last is not None and now - last < LOG_EVERY_S:
            return
        if len(self._logged) >= _MAX_PEERS:
            self._forget(now)
        self._logged[peer] = now
        log.warning(
            "grpc_call_refused",
            peer=peer,
            service=label,
            reason=reason,
            note=f"further refusals of this peer are not logged for {LOG_EVERY_S:.0f}s",
        )

    def _forget(self, now: float) -> None:
        for peer, at in list(self._logged.items()):
            if now - at >= LOG_EVERY_S:
                del self._logged[peer]
        while len(self._logged) >= _MAX_PEERS:  # all recent: drop the oldest
            del self._logged[next(iter(self._logged))]


def _guarded(handler: Any, check: Callable[[Any], Any], *, call: bool) -> Any:
    """A handler of ``handler``'s shape that awaits ``check(context)`` first (which aborts a
    refused call), then, when ``call``, runs ``handler``."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            await check(context)
            return await uu(request, context) if call else None

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.stream_stream is not None or handler.unary_stream is not None:
        inner = handler.stream_stream or handler.unary_stream
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.stream_stream is not None
            else grpc.unary_stream_rpc_method_handler
        )
        if call and inspect.isasyncgenfunction(inner):

            async def streaming_gen(request: Any, context: Any) -> Any:
                await check(context)
                async for out in inner(request, context):
                    yield out

            return make(streaming_gen, **kw)

        async def streaming(request: Any, context: Any) -> None:
            # a servicer written with context.read/context.write returns None
            await check(context)
            if call:
                await inner(request, context)

        return make(streaming, **kw)
    su = handler.stream_unary

    async def stream_unary(requests: Any, context: Any) -> Any:
        await check(context)
        return await su(requests, context) if call else None

    return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)


# -- TLS ---------------------------------------------------------------------------------------
class CertFiles:
    """The server's certificate, key and optional client CA, loaded again at a handshake after
    any of the files changed (grpc's dynamic certificate configuration).  A changed set that
    cannot be read keeps the previous one in force (logged)."""

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self.paths = tuple(p for p in (cert, key, client_ca) if p)
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._stamp = self._stats()
        self.initial = self._config(strict=True)

    def _stats(self) -> tuple[tuple[int, int, int] | None, ...]:
        out: list[tuple[int, int, int] | None] = []
        for p in self.paths:
            try:
                st = os.stat(p)
            except OSError:
                out.append(None)
            else:
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _config(self, *, strict: bool) -> Any:
        try:
            key = Path(self.key).read_bytes()
            cert = Path(self.cert).read_bytes()
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            if strict:
                raise AccessConfigError(f"gRPC TLS: {exc}") from exc
            log.error("grpc_tls_files_unreadable", error=str(exc), note="keeping the last ones")
            return None
        for what, data, marker in (
            ("certificate", cert, b"CERTIFICATE"),
            ("key", key, b"PRIVATE KEY"),
            ("client CA", ca, b"CERTIFICATE"),
        ):
            if data is not None and marker not in data:
                if strict:
                    raise AccessConfigError(f"gRPC TLS: the {what} file is not PEM ({marker!r})")
                log.error("grpc_tls_file_not_pem", file=what, note="keeping the last ones")
                return None
        try:  # a key that is not the certificate's (a renewal caught half-way) is refused
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            if strict:
                raise AccessConfigError(f"gRPC TLS: certificate and key: {exc}") from exc
            log.error("grpc_tls_pair_unusable", error=str(exc), note="keeping the last ones")
            return None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> Any:
        """grpc's fetcher (called at each handshake): a new configuration, or None for no
        change."""
        stamp = self._stats()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        new = self._config(strict=False)
        if new is not None:
            log.info("grpc_tls_reloaded", cert=self.cert)
        return new


def server_credentials(files: CertFiles) -> Any:
    """TLS credentials for the port; with a client CA, every client must present a
    certificate that CA signed (the handshake fails otherwise)."""
    return grpc.dynamic_ssl_server_credentials(
        files.initial, files.fetch, require_client_authentication=bool(files.client_ca)
    )


@dataclass(frozen=True)
class PortSecurity:
    """What ``ai-quota serve`` puts on its gRPC port(s): the guard, and TLS when ``tls_files``
    is set (the files were read once, so a bad one fails the start)."""

    guard: PortGuard
    tls_files: CertFiles | None = None

    @property
    def tls(self) -> bool:
        """Whether the port(s) serve TLS."""
        return self.tls_files is not None

    def credentials(self) -> Any:
        """Server credentials for one listener (None: plaintext).  Each listener gets its own:
        grpc does not share a dynamic configuration between servers, and each fetcher must see
        a change of the files for itself."""
        if self.tls_files is None:
            return None
        f = self.tls_files
        return server_credentials(CertFiles(f.cert, f.key, f.client_ca))


def check_settings(
    *,
    address: str,
    insecure: bool,
    token_file: str,
    tls_cert: str,
    tls_key: str,
    client_ca: str,
    allowed_sans: list[str],
    allow_plaintext: bool,
    rls_address: str = "",
) -> None:
    """Refuse settings that leave the port open by accident (:class:`AccessConfigError`).

    ``rls_address``: the RLS API's own listener (``AIQ_RLS_ADDRESS``, "" when it shares the
    gRPC port).  It takes the same caller token as the gRPC port, so it is held to the same
    rule: no token in plaintext off loopback."""
    if bool(tls_cert) != bool(tls_key):
        raise AccessConfigError("--grpc-tls-cert and --grpc-tls-key go together (PEM files)")
    if client_ca and not tls_cert:
        raise AccessConfigError(
            "--grpc-tls-client-ca (mutual TLS) needs --grpc-tls-cert and --grpc-tls-key"
        )
    if allowed_sans and not client_ca:
        raise AccessConfigError("--grpc-allowed-san needs --grpc-tls-client-ca (mutual TLS)")
    if not token_file and not client_ca:
        if insecure:
            return
        raise AccessConfigError(
            "the gRPC port (ext_proc, RLS, usage) needs caller credentials: a bearer token "
            "file (--grpc-token-file / AIQ_GRPC_TOKEN_FILE) and/or client certificates "
            "(--grpc-tls-client-ca with --grpc-tls-cert/--grpc-tls-key); to serve anyone "
            "without credentials, say so: --insecure or AIQ_INSECURE=1 (docs/security.md)"
        )
    plaintext = token_file and not tls_cert and not allow_plaintext and not insecure
    if not plaintext:
        return
    listeners = [("the gRPC port", address)]
    if rls_address:
        listeners.append(("the RLS API's own port (AIQ_RLS_ADDRESS)", rls_address))
    for what, where in listeners:
        if not is_loopback(where.rpartition(":")[0]):
            raise AccessConfigError(
                f"{what} on non-loopback address {where!r} would receive bearer "
                "tokens in plaintext: give --grpc-tls-cert and --grpc-tls-key (TLS on every "
                "gRPC listener, this one included), or set AIQ_GRPC_ALLOW_PLAINTEXT=1 when a "
                "mesh in front terminates TLS"
            )


def build(
    *,
    address: str,
    insecure: bool,
    token_file: str,
    tls_cert: str,
    tls_key: str,
    client_ca: str,
    allowed_sans: list[str],
    allow_plaintext: bool,
    admin_token: Any,
    refused: Any,
    rls_address: str = "",
) -> PortSecurity:
    """The credentials and guard of the port, or :class:`AccessConfigError`."""
    check_settings(
        address=address,
        insecure=insecure,
        token_file=token_file,
        tls_cert=tls_cert,
        tls_key=tls_key,
        client_ca=client_ca,
        allowed_sans=allowed_sans,
        allow_plaintext=allow_plaintext,
        rls_address=rls_address,
    )
    tokens = TokenSet(token_file) if token_file else None
    files = CertFiles(tls_cert, tls_key, client_ca) if tls_cert else None
    open_port = tokens is None and not client_ca
    guard = PortGuard(
        tokens=tokens,
        client_certs=bool(client_ca),
        allowed_sans=allowed_sans,
        admin_token=admin_token,
        refused=refused,
        open_port=open_port,
    )
    if open_port:
        log.warning(
            "grpc_port_open",
            address=address,
            tls=files is not None,
            note="--insecure: anyone who reaches this port may call ext_proc, RLS and usage",
        )
    return PortSecurity(guard=guard, tls_files=files)
