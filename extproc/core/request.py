"""Parse and validate an OpenAI-style request body (``/v1/chat/completions``, ``/v1/completions``).

Pure: bytes in, a :class:`ParsedRequest` out, or :class:`extproc.errors.BadRequest` naming
the field that is wrong.  Token budgets are validated here and clamped by
:func:`effective_output_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from extproc.errors import BadRequest

Endpoint = Literal["chat", "completions"]

ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/chat/completions": "chat",
    "/completions": "completions",
}


@dataclass(slots=True)
class ParsedRequest:
    """What admission needs to know about a request body."""

    endpoint: Endpoint
    model: str
    stream: bool
    client_include_usage: bool
    n: int
    declared_max_output: int | None
    body: dict[str, Any]


def endpoint_for_path(path: str) -> Endpoint | None:
    """The endpoint kind for a ``:path`` (query string ignored), or None if not metered."""
    bare = path.split("?", 1)[0].split("#", 1)[0]
    # Envoy merges slashes and normalises the path before us (see envoy_config); a trailing
    # slash must not turn a metered endpoint into an unmetered one either.
    while "//" in bare:
        bare = bare.replace("//", "/")
    if len(bare) > 1:
        bare = bare.rstrip("/")
    return ENDPOINTS.get(bare.lower())


def _int_field(body: dict[str, Any], name: str, *, minimum: int, ceiling: int) -> int | None:
    if name not in body or body[name] is None:
        return None
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
            body[name] = v  # upstream gets the integer, and clamping sees it
        else:
            raise BadRequest(
                f"'{name}' must be an integer, got {type(v).__name__} {v!r}"[:200], param=name
            )
    if v < minimum:
        raise BadRequest(f"'{name}' must be at least {minimum}, got {v}", param=name)
    if v > ceiling:
        raise BadRequest(f"'{name}' must be at most {ceiling}, got {v}", param=name)
    return v


def parse_request(
    raw: bytes, endpoint: Endpoint, *, max_tokens_ceiling: int, max_n: int
) -> ParsedRequest:
    """Validate the body and extract model, stream flags, ``n`` and the declared output budget."""
    if not raw:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest(
                "'messages' is required and must be a non-empty array", param="messages"
            )
    elif "prompt" not in body:
        raise BadRequest("'prompt' is required", param="prompt")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise BadRequest(
                "'stream_options.include_usage' must be a boolean", param="stream_options"
            )
        include_usage = iu
    n = _int_field(body, "n", minimum=1, ceiling=max_n) or 1
    budgets = [
        b
        for b in (
            _int_field(body, "max_tokens", minimum=1, ceiling=max_tokens_ceiling),
            _int_field(body, "max_completion_tokens", minimum=1, ceiling=max_tokens_ceiling),
        )
        if b is not None
    ]
    declared = max(budgets) if budgets else None
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        client_include_usage=include_usage,
        n=n,
        declared_max_output=declared,
        body=body,
    )


def effective_output_budget(declared: int | None, model_cap: int) -> int:
    """Output tokens one choice may generate: the client's budget clamped to the model's cap."""
    if declared is None:
        return model_cap
    return min(declared, model_cap)


def rewrite_body(
    req: ParsedRequest,
    *,
    clamp_to: int | None,
    force_include_usage: bool,
    canonical_model: str | None = None,
) -> bytes | None:
    """The mutated body to send upstream, or None when nothing needs to change.

    ``clamp_to`` replaces both budget fields when the declared budget exceeds the model's cap;
    ``force_include_usage`` asks a streaming upstream for the final usage chunk;
    ``canonical_model`` replaces an alias with the model's real name.
    """
    changed = False
    body = req.body
    if canonical_model is not None and body.get("model") != canonical_model:
        body["model"] = canonical_model
        changed = True
    if clamp_to is not None:
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and body[name] > clamp_to:
                body[name] = clamp_to
                changed = True
    if force_include_usage and req.stream and not req.client_include_usage:
        so = body.get("stream_options")
        so = dict(so) if isinstance(so, dict) else {}
        so["include_usage"] = True
        body["stream_options"] = so
        changed = True
    if not changed:
        return None
    return orjson.dumps(body)
