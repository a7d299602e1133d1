"""Who may call the admin API, and who did: the bearer token, client certificates, the
listener checks, and the caller's name written into the audit log.

Two credentials, either or both:

* **a bearer token** read from ``--admin-token-file``.  The file is checked on every call
  (one ``stat``) and read again when it changed, so rotating it (a Kubernetes Secret update,
  an atomic rename) needs no restart.  A file that became unreadable or empty refuses every
  call until it is fixed: an operator who blanked the token meant to stop the old one.
* **mutual TLS**: with ``--admin-tls-client-ca`` the server asks every client for a
  certificate signed by that CA and refuses the connection without one.

A call's *principal*, recorded in the audit log, names the credential that let it in:
``cert:<subject CN>`` and/or ``token:<first 12 hex of the token's SHA-256>`` (never the token),
or ``loopback`` when the API runs unauthenticated on loopback.  A client may add who it acts
for (``x-aiq-actor`` metadata, e.g. the operator's login); it is recorded as such, unverified.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from extproc.admin.errors import AdminConfigError

log = structlog.get_logger("extproc.admin")

#: Metadata a client may set to say on whose behalf it calls (recorded, not verified).
ACTOR_METADATA = "x-aiq-actor"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def fingerprint(token: str) -> str:
    """What the logs and the audit trail show of a token."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


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


class TokenFile:
    """The token in a file, read again whenever the file changes (checked per call)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        self._token: str | None = read_token(path)  # at start a bad file is a config error
        self._digest = _digest(self._token)

    @classmethod
    def fixed(cls, token: str) -> TokenFile:
        """A token held in memory only (no file to follow): embedding and tests."""
        if not token:
            raise AdminConfigError("the admin token is empty")
        self = cls.__new__(cls)
        self.path, self._stamp, self._token, self._digest = "", None, token, _digest(token)
        return self

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows symlinks: a Secret volume swaps its ..data link
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> str | None:
        """The token now in force; None while the file is unreadable or empty."""
        if not self.path:
            return self._token
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                token = read_token(self.path)
            except AdminConfigError as exc:
                self._token = None
                log.error("admin_token_file_unusable", error=str(exc), note="refusing every call")
            else:
                if token != self._token:
                    log.info("admin_token_reloaded", path=self.path, principal=fingerprint(token))
                self._token, self._digest = token, _digest(token)
        return self._token

    def matches(self, presented: str) -> bool:
        """Whether ``presented`` is the token in force (constant-time comparison)."""
        token = self.current()
        if token is None or not presented:
            return False
        return hmac.compare_digest(_digest(presented), self._digest)


def bearer(metadata: Any) -> str:
    """The token of an ``authorization: Bearer <token>`` entry ("" when there is none)."""
    presented = ""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            presented = value
    scheme, _, token = presented.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class BearerAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: TokenFile, on_refused: Any = None) -> None:
        self.token = token
        self.on_refused = on_refused
        self._deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    def allows(self, metadata: Any) -> bool:
        """Whether the call's metadata carries the token in force."""
        return self.token.matches(bearer(metadata))

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        """Pass an authenticated call on; answer any other with UNAUTHENTICATED."""
        if self.allows(details.invocation_metadata):
            return await continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        log.warning("admin_unauthenticated", method=method)
        if self.on_refused is not None:
            self.on_refused(method)
        return self._deny


async def _unauthenticated(request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin bearer token")


@dataclass(frozen=True)
class Caller:
    """Who made a call: the credential that let it in, and who it says it acts for."""

    principal: str
    on_behalf_of: str = ""
    peer: str = ""


def caller(context: Any, token: TokenFile | None) -> Caller:
    """The :class:`Caller` of an admitted call (the interceptor already checked the token)."""
    parts: list[str] = []
    try:
        auth = context.auth_context() or {}
    except Exception:  # a context without TLS information
        auth = {}
    names = auth.get("x509_common_name") or []
    if names:
        parts.append("cert:" + _text(names[0]))
    metadata = context.invocation_metadata() or ()
    if token is not None:
        presented = bearer(metadata)
        if presented:
            parts.append(fingerprint(presented))
    on_behalf = ""
    for key, value in metadata:
        if key == ACTOR_METADATA and isinstance(value, str):
            on_behalf = value[:128]
    try:
        peer = str(context.peer() or "")
    except Exception:
        peer = ""
    return Caller("+".join(parts) or "loopback", on_behalf, peer)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (``localhost``, 127/8, ``::1``)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_listen(
    host: str,
    *,
    token: bool,
    tls: bool,
    client_certs: bool = False,
    allow_plaintext: bool = False,
) -> None:
    """Refuse an admin listener that anyone on the network could use or sniff."""
    if client_certs and not tls:
        raise AdminConfigError(
            "--admin-tls-client-ca needs --admin-tls-cert and --admin-tls-key (mutual TLS)"
        )
    if is_loopback(host):
        if not token and not client_certs:
            log.warning(
                "admin_unauthenticated_on_loopback",
                host=host,
                note="anything on this machine may call the admin API; set --admin-token-file",
            )
        return
    if not token and not client_certs:
        raise AdminConfigError(
            f"the admin API on non-loopback address {host!r} needs credentials: a bearer token "
            "(--admin-token-file or AIQ_ADMIN_TOKEN_FILE) or client certificates "
            "(--admin-tls-client-ca)"
        )
    if not tls and not allow_plaintext:
        raise AdminConfigError(
            f"the admin API on non-loopback address {host!r} would send its token in plaintext: "
            "give --admin-tls-cert and --admin-tls-key (or set AIQ_ADMIN_ALLOW_PLAINTEXT=1 when "
            "a proxy in front terminates TLS)"
        )


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> Any:
    """TLS credentials from PEM files; with ``client_ca``, clients must present a certificate
    that CA signed."""
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
        ca = Path(client_ca).read_bytes() if client_ca else None
    except OSError as exc:
        raise AdminConfigError(f"admin TLS: {exc}") from exc
    if ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=True)
