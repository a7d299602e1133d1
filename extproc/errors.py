"""The gateway's error hierarchy.

Every error a request can meet is one of these classes; each carries the HTTP status
and the OpenAI-style ``type``/``code`` it maps to.  They are turned into responses in
one place per API format: ``extproc.core.apis`` (OpenAI shapes in
:mod:`extproc.core.apis.errors`).

::

    GatewayError
    ├── ClientError                       4xx: the caller can fix it
    │   ├── AuthenticationError           401 missing / unknown API key
    │   ├── BadRequest                    400 malformed JSON, wrong types, bad budgets
    │   ├── UnknownModel                  404 (or 400) model not configured
    │   ├── PathNotAllowed                404 path outside the metered API
    │   ├── RequestTooLarge               413 body or prompt larger than allowed
    │   └── QuotaExceeded                 429 a RPM/TPM bucket refused the request
    └── ServerError                       5xx: the gateway cannot decide
        ├── LimiterUnavailable            503 Redis unreachable or timed out (fail-closed)
        └── InternalError                 500 a bug; logged with a traceback
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class GatewayError(Exception):
    """Base of every error that becomes an HTTP response."""

    status: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ClientError(GatewayError):
    """The request is wrong; retrying it unchanged will fail again."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationError(ClientError):
    """No API key, or a key the gateway does not know."""

    status = 401
    code = "invalid_api_key"


class PermissionDenied(ClientError):
    """A verified identity the gateway has no tenant for."""

    status = 403
    error_type = "invalid_request_error"
    code = "permission_denied"


class BadRequest(ClientError):
    """Malformed JSON, wrong field types, negative or non-integer token budgets."""

    status = 400


class UnknownModel(ClientError):
    """The model is not configured and the policy rejects unknown models."""

    status = 404
    code = "model_not_found"

    def __init__(self, message: str, *, status: int = 404) -> None:
        super().__init__(message, param="model")
        self.status = status


class PathNotAllowed(ClientError):
    """A path the gateway does not meter, under the ``reject`` policy."""

    status = 404
    code = "unknown_url"


class RequestTooLarge(ClientError):
    """The body or prompt exceeds the configured maximum."""

    status = 413
    code = "request_too_large"


@dataclass(frozen=True, slots=True)
class RateLimitHeaders:
    """OpenAI's ``x-ratelimit-*`` header values for the binding RPM and TPM buckets."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    # money (in the currency: "50.00") or weighted-token budgets, and concurrent requests
    limit_budget: str | None = None
    remaining_budget: str | None = None
    reset_budget_s: float | None = None
    budget_unit: str | None = None
    limit_concurrency: int | None = None
    remaining_concurrency: int | None = None
    # (family, level) where the binding bucket of a family is a level's: ("tokens",
    # "organisation=acme") -> x-ratelimit-level-tokens: organisation=acme
    levels: tuple[tuple[str, str], ...] = ()
    # how long a request of a plan that waits waited before this refusal (docs/semantics.md,
    # "Waiting": x-ratelimit-waited-ms); None: not a waiting plan's refusal
    waited_ms: int | None = None

    def as_pairs(self) -> list[tuple[str, str]]:
        """The headers to send, in OpenAI's names; absent buckets are omitted."""
        out: list[tuple[str, str]] = []
        if self.limit_requests is not None:
            out.append(("x-ratelimit-limit-requests", str(self.limit_requests)))
            out.append(
                ("x-ratelimit-remaining-requests", str(max(0, self.remaining_requests or 0)))
            )
            out.append(
                ("x-ratelimit-reset-requests", format_duration(self.reset_requests_s or 0.0))
            )
        if self.limit_tokens is not None:
            out.append(("x-ratelimit-limit-tokens", str(self.limit_tokens)))
            out.append(("x-ratelimit-remaining-tokens", str(max(0, self.remaining_tokens or 0))))
            out.append(("x-ratelimit-reset-tokens", format_duration(self.reset_tokens_s or 0.0)))
        if self.limit_budget is not None:
            out.append(("x-ratelimit-limit-budget", self.limit_budget))
            out.append(("x-ratelimit-remaining-budget", self.remaining_budget or "0"))
            out.append(("x-ratelimit-reset-budget", format_duration(self.reset_budget_s or 0.0)))
            out.append(("x-ratelimit-budget-unit", self.budget_unit or ""))
        if self.limit_concurrency is not None:
            out.append(("x-ratelimit-limit-concurrency", str(self.limit_concurrency)))
            out.append(
                ("x-ratelimit-remaining-concurrency", str(max(0, self.remaining_concurrency or 0)))
            )
        for family, level in self.levels:
            out.append((f"x-ratelimit-level-{family}", level))
        if self.waited_ms is not None:
            out.append(("x-ratelimit-waited-ms", str(self.waited_ms)))
        return out


def format_duration(seconds: float) -> str:
    """Render a reset time the way OpenAI does: ``1s``, ``6m0s``, ``120ms``."""
    if seconds <= 0:
        return "0s"
    if round(seconds * 1000) < 1000:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = int(seconds + 0.999)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


class QuotaExceeded(ClientError):
    """A bucket refused the request; carries the headers and the retry delay."""

    status = 429
    error_type = "requests"
    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        metric: str,
        retry_after_s: float | None,
        headers: RateLimitHeaders,
        level: str = "",
        limit: Any = None,
    ) -> None:
        super().__init__(message)
        self.metric = metric
        self.level = level  # the level that refused: ``organisation=acme`` ("" none named)
        # the rule that refused (an ``extproc.core.rules.Limit``: traces name it), when known
        self.limit = limit
        self.error_type, self.code = _REFUSALS.get(metric, ("requests", "rpm_limit_exceeded"))
        self.retry_after_s = retry_after_s
        self.headers = headers


# The error type and code of a refusal by each limit kind.
_REFUSALS = {
    "rpm": ("requests", "rpm_limit_exceeded"),
    "tpm": ("tokens", "tpm_limit_exceeded"),
    "cost": ("budget", "budget_exceeded"),
    "concurrency": ("requests", "concurrency_limit_exceeded"),
    "users": ("requests", "end_users_limit_exceeded"),
}


class UnsupportedEncoding(ClientError):
    """A request body the gateway cannot read (compressed with an encoding it does not take)."""

    status = 415
    code = "unsupported_content_encoding"


class ServerError(GatewayError):
    """The gateway could not decide; not the caller's fault."""

    status = 500


class LimiterUnavailable(ServerError):
    """The shared counters (Redis) are unreachable or too slow, and the policy fails closed."""

    status = 503
    error_type = "server_error"
    code = "quota_backend_unavailable"

    def __init__(self, message: str, *, maybe_ran: bool = False) -> None:
        super().__init__(message)
        # the call timed out rather than failed: Redis may still run it when it answers again
        self.maybe_ran = maybe_ran


class GatewayBusy(ServerError):
    """The gateway could not count the prompt in time (a burst of very large prompts)."""

    status = 503
    error_type = "server_error"
    code = "gateway_busy"


class UnmeterableResponse(ServerError):
    """A 2xx upstream response the gateway cannot count (fail-closed plans)."""

    status = 502
    error_type = "server_error"
    code = "unmeterable_response"


class InternalError(ServerError):
    """An unexpected failure inside the gateway."""

    status = 500
    code = "internal_error"


@dataclass(slots=True)
class ErrorBody:
    """An OpenAI-style error object, ready to serialise."""

    message: str
    type: str
    code: str
    param: str | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """``{"error": {...}}`` in OpenAI's shape."""
        err: dict[str, object] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        err.update(self.extra)
        return {"error": err}


class StreamCut(GatewayError):
    """Why the gateway ended a response stream itself, rendered as the API's in-stream error.

    ``status`` is the HTTP status the same error would have had before the response began
    (429 for an exhausted quota, 503 when the backend is unavailable or the server stops).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        error_type: str,
        code: str,
        limit: Any = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.code = code
        # the rule that ran out (a quota cut: an ``extproc.core.rules.Limit``; traces name it)
        self.limit = limit
