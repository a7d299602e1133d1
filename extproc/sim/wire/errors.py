"""The error bodies the simulator answers with: OpenAI's ``{"error": {...}}`` and Anthropic's
``{"type": "error", "error": {...}}``, typed by HTTP status.
"""

from __future__ import annotations

from typing import Any

_OPENAI_ERROR_TYPES: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    408: ("timeout", None),
    409: ("conflict_error", None),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
}

_ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI-style error object for ``status``."""
    err_type, default_code = _OPENAI_ERROR_TYPES.get(
        status, ("server_error", None) if status >= 500 else ("invalid_request_error", None)
    )
    return {
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": code if code is not None else default_code,
        }
    }


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic-style error object for ``status``."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    return {
        "type": "error",
        "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status, default), "message": message},
    }
