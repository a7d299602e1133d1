"""The end user a request names (docs/semantics.md, "Levels"): pure lookups, no IO.

Sources, tried in the configured order: ``body`` (OpenAI's ``user`` field; Anthropic's
``metadata.user_id``), ``header`` (a header a trusted filter sets) and ``jwt`` (a claim of the
verified token, from Envoy's ``jwt_authn`` metadata).  The id is the client's text: it names a
counter (bounded, digested when long or odd: :func:`extproc.core.keys.user_segment`) and
never a metric label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Longest end-user id taken as sent (a longer one is cut here, then digested in keys).
MAX_USER_CHARS = 256


def from_body(api: str, body: Mapping[str, Any]) -> str:
    """The end user a request body names ("" when none)."""
    if api == "messages":
        meta = body.get("metadata")
        value = meta.get("user_id") if isinstance(meta, Mapping) else None
    else:
        value = body.get("user")
    if isinstance(value, str) and value:
        return value[:MAX_USER_CHARS]
    return ""


def _claim(payload: Mapping[str, Any], path: str) -> str:
    cur: Any = payload
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return ""
        cur = cur[part]
    if isinstance(cur, bool) or not isinstance(cur, str | int):
        return ""
    return str(cur)[:MAX_USER_CHARS]


def before_body(
    sources: Sequence[str],
    headers: Mapping[str, str],
    *,
    header: str,
    jwt_payload: Mapping[str, Any] | None = None,
    jwt_claim: str = "user",
) -> tuple[str, bool]:
    """What the request headers say: (the end user of the first header or JWT source that
    names one, "" when none; whether the body is to be asked first, i.e. ``body`` comes
    before that source, or is a source at all when none named one)."""
    body_first = False
    for src in sources:
        if src == "body":
            body_first = True
            continue
        value = ""
        if src == "header":
            value = headers.get(header.lower(), "")[:MAX_USER_CHARS]
        elif src == "jwt" and jwt_payload is not None:
            value = _claim(jwt_payload, jwt_claim)
        if value:
            return value, body_first
    return "", body_first


def resolve(hint: str, body_first: bool, api: str, body: Mapping[str, Any] | None) -> str:
    """The request's end user: the body's when asked first and it names one, else the
    headers' (``hint``); "" when nothing names one."""
    if body_first and body is not None:
        found = from_body(api, body)
        if found:
            return found
    return hint
