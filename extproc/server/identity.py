"""Request headers: who is calling (API key → tenant) and what the path is for.

A key is read from ``Authorization: Bearer``, ``api-key`` (Azure style) or ``x-api-key``
(Anthropic style) and looked up by its SHA-256 digest; a client's own ``x-quota-*`` headers
are replaced by ours.  A path is a metered API, an allow-listed path (unmetered) or
"other", handled by ``paths.other``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extproc.config.load import key_digest
from extproc.config.runtime import ApiKey, RuntimeConfig, Tenant
from extproc.core.apis.base import ApiFormat
from extproc.core.apis.registry import api_for_path, normalise_path, path_allowed
from extproc.errors import AuthenticationError, PathNotAllowed

IDENTITY_HEADERS = ("x-quota-tenant", "x-quota-plan", "x-quota-key", "x-quota-input-tokens")

Route = Literal["metered", "pass", "rpm_only"]


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


def identify(cfg: RuntimeConfig, h: dict[str, str]) -> Caller:
    """The caller named by the request's API key; 401 when missing or unknown."""
    presented = presented_key(h)
    if not presented:
        raise AuthenticationError(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')."
        )
    key = cfg.keys_by_digest.get(key_digest(presented))
    if key is None:
        raise AuthenticationError(f"Incorrect API key provided: {mask(presented)}.")
    return Caller(key=key, tenant=cfg.tenants[key.tenant])


def route(cfg: RuntimeConfig, path: str, method: str) -> tuple[Route, ApiFormat | None]:
    """How a request to ``path`` is handled, and its API format when metered."""
    api = api_for_path(path) if method == "POST" else None
    if api is not None:
        return "metered", api
    if path_allowed(path, cfg.allowed_paths):
        return "pass", None
    policy = cfg.other_paths
    if policy == "reject":
        raise PathNotAllowed(
            f"The gateway does not serve {method} {normalise_path(path)}: it is not a metered "
            "API (chat/completions, completions, responses, messages, embeddings) nor in "
            "paths.allow."
        )
    return ("rpm_only" if policy == "rpm_only" else "pass"), None


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
