"""How a request's path is handled (sans-IO): metered as an API call, passed as it is, counted
on the RPM limits only, or refused (:func:`route`); and which paths pass without an identity
(:func:`public_path`).  The server reads the patterns from the configuration and executes the
answer (:mod:`extproc.server.identity` identifies the caller)."""

from __future__ import annotations

from typing import Literal

from extproc.core.apis.base import ApiFormat
from extproc.core.apis.registry import api_for_path, normalise_path, path_allowed
from extproc.errors import PathNotAllowed

#: How a request's path is handled.
Route = Literal["metered", "pass", "rpm_only"]


def route(
    path: str, method: str, *, allowed: tuple[str, ...], other: str
) -> tuple[Route, ApiFormat | None]:
    """How a request to ``path`` is handled, and its API format when metered: a metered API
    call (POST), an allow-listed path (``paths.allow``) passed, any other as ``paths.other``
    says (``reject``: a 404-style client error; ``rpm_only``: counted on the RPM limits;
    else passed)."""
    api = api_for_path(path) if method == "POST" else None
    if api is not None:
        return "metered", api
    if path_allowed(path, allowed):
        return "pass", None
    if other == "reject":
        raise PathNotAllowed(
            f"The gateway does not serve {method} {normalise_path(path)}: it is not a metered "
            "API (chat/completions, completions, responses, messages, embeddings) nor in "
            "paths.allow."
        )
    return ("rpm_only" if other == "rpm_only" else "pass"), None


def public_path(
    path: str, method: str, *, allowed: tuple[str, ...], public: tuple[str, ...]
) -> bool:
    """Whether ``path`` passes without an identity: allow-listed (``paths.allow``), listed in
    ``paths.public`` too, and not a metered API call."""
    if method == "POST" and api_for_path(path) is not None:
        return False
    return path_allowed(path, allowed) and path_allowed(path, public)
