"""Which API format a path is served by, and the paths allowed through unmetered."""

from __future__ import annotations

from extproc.core.apis.base import ApiFormat
from extproc.core.apis.embeddings import EMBEDDINGS
from extproc.core.apis.messages import MESSAGES
from extproc.core.apis.openai import CHAT, COMPLETIONS
from extproc.core.apis.responses import RESPONSES

_BY_PATH: dict[str, ApiFormat] = {
    f"{prefix}{path}": api
    for prefix in ("/v1", "")
    for path, api in (
        ("/chat/completions", CHAT),
        ("/completions", COMPLETIONS),
        ("/responses", RESPONSES),
        ("/messages", MESSAGES),
        ("/embeddings", EMBEDDINGS),
    )
}


def normalise_path(path: str) -> str:
    """The path without query or fragment, slashes merged, no trailing slash, lower case.

    Envoy normalises and merges slashes before us (see envoy_config); a trailing slash or
    upper case must not turn a metered endpoint into an unmetered one either."""
    bare = path.split("?", 1)[0].split("#", 1)[0]
    while "//" in bare:
        bare = bare.replace("//", "/")
    if len(bare) > 1:
        bare = bare.rstrip("/")
    return bare.lower()


def api_for_path(path: str) -> ApiFormat | None:
    """The API format served at ``path``, or None when the path is not metered."""
    return _BY_PATH.get(normalise_path(path))


def path_allowed(path: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``path`` is in an allow-list (``/x/*`` matches ``/x`` and everything below)."""
    bare = normalise_path(path)
    for pattern in patterns:
        p = pattern.lower()
        if p.endswith("/*"):
            if bare == p[:-2] or bare.startswith(p[:-1]):
                return True
        elif bare == p.rstrip("/"):
            return True
    return False
