"""Request headers: who is calling (what the path is for is the core's
:mod:`extproc.core.routing`).

The caller comes from the sources ``identity.sources`` lists, in order:

* ``api_key``: the gateway's own keys, from ``Authorization: Bearer``, ``api-key`` (Azure
  style) or ``x-api-key`` (Anthropic style), looked up by SHA-256 digest; a key that is
  presented must be valid (401), an absent one lets the next source try;
* ``jwt``: the payload Envoy's ``jwt_authn`` filter verified and put in dynamic metadata
  (forwarded to us with ``metadata_options``); a client cannot forge it;
* ``header``: headers an earlier Envoy filter set after removing the client's own.

A client's own ``x-quota-*`` headers are replaced by ours.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.config.load import key_digest
from extproc.config.runtime import ApiKey, RuntimeConfig, Tenant
from extproc.core import end_users
from extproc.errors import AuthenticationError, PermissionDenied

IDENTITY_HEADERS = ("x-quota-tenant", "x-quota-plan", "x-quota-key", "x-quota-input-tokens")


@dataclass(frozen=True, slots=True)
class Caller:
    """The identified caller."""

    key: ApiKey
    tenant: Tenant

    def headers(self) -> list[tuple[str, str]]:
        """The identity headers the upstream receives."""
        return [
            ("x-quota-tenant", self.tenant.id),
            ("x-quota-plan", self.tenant.plan),
            ("x-quota-key", self.key.name),
        ]


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._@-]")


def identify(
    cfg: RuntimeConfig, h: dict[str, str], metadata: Mapping[str, Any] | None = None
) -> Caller:
    """The caller, from the first configured source that names one; 401 when none does."""
    for source in cfg.identity.sources:
        if source == "api_key":
            presented = presented_key(h)
            if not presented:
                continue
            key = cfg.keys_by_digest.get(key_digest(presented))
            if key is None:
                raise AuthenticationError(f"Incorrect API key provided: {mask(presented)}.")
            return Caller(key=key, tenant=cfg.tenants[key.tenant])
        caller = _from_jwt(cfg, metadata or {}) if source == "jwt" else _from_headers(cfg, h)
        if caller is not None:
            return caller
    if cfg.identity.sources == ["api_key"]:
        raise AuthenticationError(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')."
        )
    raise AuthenticationError(
        "The request carries no identity the gateway trusts (accepted: "
        f"{', '.join(cfg.identity.sources)})."
    )


def _claim(payload: Mapping[str, Any], path: str) -> str | None:
    cur: Any = payload
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    if isinstance(cur, bool) or not isinstance(cur, str | int):
        return None
    return str(cur)


def _caller(cfg: RuntimeConfig, tenant_value: str, key_value: str | None, via: str) -> Caller:
    tid = (
        cfg.identity.jwt.tenant_map.get(tenant_value, tenant_value)
        if via == "jwt"
        else tenant_value
    )
    tenant = cfg.tenants.get(tid)
    if tenant is None:
        raise PermissionDenied(
            f"The tenant '{tid[:64]}' named by the {via} identity is not configured on this "
            "gateway."
        )
    name = _SAFE_NAME.sub("_", key_value or via)[:64]
    return Caller(key=ApiKey(name=f"{via}:{name}", tenant=tid), tenant=tenant)


def end_user_hint(
    cfg: RuntimeConfig, h: dict[str, str], metadata: Mapping[str, Any] | None
) -> tuple[str, bool]:
    """The end user the request's headers or token name, and whether its body is asked first
    (:func:`extproc.core.end_users.before_body`)."""
    pol = cfg.end_users
    payload = None
    if metadata is not None and "jwt" in pol.sources:
        ns = metadata.get(cfg.identity.jwt.metadata_namespace)
        found = ns.get(cfg.identity.jwt.payload_key) if isinstance(ns, Mapping) else None
        payload = found if isinstance(found, Mapping) else None
    return end_users.before_body(
        pol.sources, h, header=pol.header, jwt_payload=payload, jwt_claim=pol.jwt_claim
    )


def _from_jwt(cfg: RuntimeConfig, metadata: Mapping[str, Any]) -> Caller | None:
    jwt = cfg.identity.jwt
    ns = metadata.get(jwt.metadata_namespace)
    payload = ns.get(jwt.payload_key) if isinstance(ns, Mapping) else None
    if not isinstance(payload, Mapping):
        return None
    tenant = _claim(payload, jwt.tenant_claim)
    if tenant is None:
        raise PermissionDenied(f"The token has no '{jwt.tenant_claim}' claim naming a tenant.")
    key = _claim(payload, jwt.key_claim) if jwt.key_claim else None
    return _caller(cfg, tenant, key, "jwt")


def _from_headers(cfg: RuntimeConfig, h: dict[str, str]) -> Caller | None:
    hdr = cfg.identity.header
    tenant = h.get(hdr.tenant_header.lower(), "").strip()
    if not tenant:
        return None
    key = h.get(hdr.key_header.lower(), "").strip() if hdr.key_header else None
    return _caller(cfg, tenant, key or None, "header")


def presented_key(h: dict[str, str]) -> str:
    """The API key the client sent, '' if none."""
    auth = h.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (h.get("x-api-key") or h.get("api-key") or "").strip()


def mask(key: str) -> str:
    """A key safe to echo back: its first 3 and last 4 characters."""
    if len(key) <= 8:
        return "*" * len(key)
    return f"{key[:3]}{'*' * 8}{key[-4:]}"
