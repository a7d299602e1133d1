"""Parse and validate an OpenAI-style request body (``/v1/chat/completions``, ``/v1/completions``).

Pure: bytes in, a :class:`ParsedRequest` out, or :class:`extproc.errors.BadRequest` naming
the field that is wrong.  Token budgets are validated here and clamped by
:func:`effective_output_budget`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import orjson

from extproc.core.apis.base import ParsedRequest
from extproc.errors import BadRequest

Endpoint = Literal["chat", "completions"]


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
        iu = so.get("include_usage")
        if iu is None:  # null means absent, as for every other nullable field
            iu = False
        if not isinstance(iu, bool):
            raise BadRequest(
                "'stream_options.include_usage' must be a boolean", param="stream_options"
            )
        include_usage = iu
    # Integral floats (``10.0``) are accepted and forwarded as integers.
    normalised = any(
        isinstance(body.get(f), float)
        for f in ("n", "best_of", "max_tokens", "max_completion_tokens")
    )
    n = _int_field(body, "n", minimum=1, ceiling=max_n) or 1
    sequences = n
    if endpoint == "completions":
        best_of = _int_field(body, "best_of", minimum=1, ceiling=max_n) or 1
        sequences = max(n, best_of) * _prompt_count(body["prompt"])
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
        api=endpoint,
        model=model,
        stream=stream,
        sequences=sequences,
        declared_max_output=declared,
        body=body,
        client_include_usage=include_usage,
        budget_fields=("max_tokens", "max_completion_tokens")
        if endpoint == "chat"
        else ("max_tokens",),
        notes={"normalised": True} if normalised else {},
    )


def _prompt_count(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds: a list of strings or of token-id
    lists is a batch; a string or one token-id list is one prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def effective_output_budget(declared: int | None, model_cap: int) -> int:
    """Output tokens one choice may generate: the client's budget clamped to the model's cap."""
    if declared is None:
        return model_cap
    return min(declared, model_cap)


#: The most tokens per chunk a client may ask a streaming engine for (vLLM's per-request
#: ``stream_interval``): the meter charges and cuts chunk by chunk, and the tokens an engine
#: holds back for its next chunk are unseen when the client leaves; a client's larger value
#: (100,000: every token but the first held back to the end) is lowered to this.  The same
#: bound as a model's ``exact_stream_interval``.
MAX_STREAM_INTERVAL = 16


def _client_interval(value: object) -> int | None:
    """A client's ``stream_interval`` as the engine would read it (an integer, a float with no
    fraction, a numeric string: pydantic's lax reading), None when it is not a number."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value) if isinstance(value, int | float | str) else None
    except ValueError:
        return None
    if number is None or not math.isfinite(number):
        return None
    return int(number)


def rewrite_body(
    req: ParsedRequest,
    *,
    budget: int | None,
    force_include_usage: bool,
    canonical_model: str | None = None,
    continuous_usage: bool = False,
    upstream_stream: bool = False,
    stream_interval: int | None = None,
) -> bytes | None:
    """The mutated body to send upstream, or None when nothing needs to change.

    ``budget`` is the per-sequence output budget admission reserved: every budget field the
    client set above it is lowered to it, and when the client set none, the first budget field
    is added with it (an upstream whose default is "the rest of the context" must not generate
    more than was reserved).  ``force_include_usage`` asks a streaming upstream for the final
    usage chunk; ``canonical_model`` replaces an alias with the model's real name;
    ``continuous_usage`` asks an engine that can (vLLM, SGLang) for the running usage in every
    chunk (``stream_options.continuous_usage_stats``), which the meter then charges by.
    ``upstream_stream``: a non-stream sent upstream as a stream with usage (the exact path:
    the gateway reassembles its JSON for the client); with ``stream_interval``, the engine is
    asked for that many tokens per chunk (vLLM's per-request ``stream_interval``: fewer
    chunks, each one ext_proc message); a client's own ``stream_interval`` never goes
    upstream on the exact path (it would choose what an abandon leaves unseen), and on a
    stream it is at most :data:`MAX_STREAM_INTERVAL`.
    """
    changed = bool(req.notes.get("normalised"))
    body = req.body
    if canonical_model is not None and body.get("model") != canonical_model:
        body["model"] = canonical_model
        changed = True
    if budget is not None:
        present = [f for f in req.budget_fields if isinstance(body.get(f), int)]
        for name in present:
            if body[name] > budget:
                body[name] = budget
                changed = True
        if not present and req.budget_fields:
            body[req.budget_fields[0]] = budget
            changed = True
    if upstream_stream and body.get("stream") is not True:
        body["stream"] = True
        changed = True
    if upstream_stream and body.get("stream_interval") != stream_interval:
        # the gateway's alone: a client's (which vLLM ignores for the non-stream it sent)
        # would choose how many generated tokens an abandon leaves unseen
        if stream_interval is None:
            del body["stream_interval"]
        else:
            body["stream_interval"] = stream_interval
        changed = True
    if req.stream and not upstream_stream and "stream_interval" in body:
        asked = _client_interval(body["stream_interval"])
        if asked is None or asked > MAX_STREAM_INTERVAL:
            # an engine holding tokens back past the bound would leave them unbilled when the
            # client leaves, and out of the meter's reach until it sends them
            body["stream_interval"] = MAX_STREAM_INTERVAL
            changed = True
    if upstream_stream or (
        req.stream and ((force_include_usage and not req.client_include_usage) or continuous_usage)
    ):
        so = body.get("stream_options")
        so = dict(so) if isinstance(so, dict) else {}
        if force_include_usage or continuous_usage or upstream_stream:
            so["include_usage"] = True
        if continuous_usage:
            so["continuous_usage_stats"] = True
        if so != body.get("stream_options"):
            body["stream_options"] = so
            changed = True
    if not changed:
        return None
    return orjson.dumps(body)
