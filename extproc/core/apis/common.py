"""Small pieces the Responses, Messages and Embeddings formats share: reading the body, integer
budget fields, the forwarded-body rewrite, compact JSON for counting definitions and the usage
of a non-streaming response.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from extproc.core.apis.base import ParsedRequest
from extproc.core.chunks import Usage
from extproc.core.tokens import (
    PromptShapeError,
    TokenCounter,
    TokenizerSpec,
    json_text,
    require_text,
)
from extproc.errors import BadRequest

__all__ = [
    "NORMALISED",
    "int_field",
    "json_object",
    "json_text",
    "object_list",
    "optional_bool",
    "require_model",
    "rewrite_fields",
    "usage_of_json",
]

#: ``ParsedRequest.notes`` key set when parsing changed the body (an integral float made an int).
NORMALISED = "normalised"


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``BadRequest`` (empty, not JSON, not an object)."""
    if not raw:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def require_model(body: Mapping[str, Any]) -> str:
    """``model``: a non-empty string."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return model


def optional_bool(body: Mapping[str, Any], name: str) -> bool:
    """A boolean field where absent and null mean false."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def object_list(body: Mapping[str, Any], name: str) -> None:
    """``BadRequest`` unless the field ``name`` is absent, null or an array of objects."""
    value = body.get(name)
    if value is not None and not (
        isinstance(value, list) and all(isinstance(v, dict) for v in value)
    ):
        raise BadRequest(f"'{name}' must be an array of objects", param=name)


def usage_of_json(body: bytes, read: Callable[[object], Usage | None]) -> Usage | None:
    """``read`` over the ``usage`` member of a non-streaming response body; None when the body
    is not a JSON object."""
    try:
        obj = orjson.loads(body)
    except (orjson.JSONDecodeError, RecursionError):
        return None
    return read(obj.get("usage")) if isinstance(obj, dict) else None


def int_field(
    body: dict[str, Any],
    name: str,
    *,
    minimum: int,
    ceiling: int,
    notes: dict[str, Any],
    required: bool = False,
) -> int | None:
    """An integer field in ``[minimum, ceiling]``; absent or null gives None (or ``BadRequest``
    when ``required``).

    An integral float (``10.0``) is accepted and written back into ``body`` as an int, so the
    upstream gets an integer; ``notes[NORMALISED]`` records that the body changed."""
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"'{name}' is required and must be an integer", param=name)
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
            body[name] = value
            notes[NORMALISED] = True
        else:
            raise BadRequest(
                f"'{name}' must be an integer, got {type(value).__name__} {value!r}"[:200],
                param=name,
            )
    if value < minimum:
        raise BadRequest(f"'{name}' must be at least {minimum}, got {value}", param=name)
    if value > ceiling:
        raise BadRequest(f"'{name}' must be at most {ceiling}, got {value}", param=name)
    return value


def rewrite_fields(
    req: ParsedRequest, *, budget: int | None, model: str | None, upstream_stream: bool = False
) -> bytes | None:
    """The body to forward with the canonical ``model`` and the output ``budget`` applied to
    ``req.budget_fields`` (lowered when larger; the first one added when none is set), and
    ``stream: true`` for a non-stream sent upstream as a stream (``upstream_stream``: its JSON
    is reassembled for the client), or None when nothing changed."""
    body = req.body
    changed = bool(req.notes.get(NORMALISED))
    if upstream_stream and body.get("stream") is not True:
        body["stream"] = True
        changed = True
    if model is not None and body.get("model") != model:
        body["model"] = model
        changed = True
    if budget is not None and req.budget_fields:
        present = [
            f
            for f in req.budget_fields
            if isinstance(body.get(f), int) and not isinstance(body.get(f), bool)
        ]
        for name in present:
            if body[name] > budget:
                body[name] = budget
                changed = True
        if not present:
            body[req.budget_fields[0]] = budget
            changed = True
    return orjson.dumps(body) if changed else None


#: Media parts are counted at the tokenizer's flat figures (``TokenizerSpec``).
IMAGE_PARTS: Final = frozenset({"image_url", "input_image", "image"})
AUDIO_PARTS: Final = frozenset({"input_audio", "audio"})
FILE_PARTS: Final = frozenset({"file", "input_file"})


def count_content_parts(
    content: Any,
    path: str,
    counter: TokenCounter,
    spec: TokenizerSpec,
    *,
    text_fields: Mapping[str, str],
    shape: str,
    inline_file_text: bool = False,
) -> int:
    """Tokens of a message ``content``: a string, or a list of typed parts (text parts by
    ``text_fields``: part type -> the field holding its text; images, audio and files at the
    flat figures, a file's inline ``text`` instead when ``inline_file_text``; any other part
    as its compact JSON). ``shape`` names what a wrong ``content`` should have been."""
    if content is None:
        return 0
    if isinstance(content, str):
        return counter.count(content)
    if not isinstance(content, list):
        raise PromptShapeError(f"{path} must be {shape}")
    total = 0
    for i, part in enumerate(content):
        part_path = f"{path}[{i}]"
        if isinstance(part, str):  # some clients send bare strings in the list
            total += counter.count(part)
            continue
        if not isinstance(part, Mapping):
            raise PromptShapeError(f"{part_path} must be an object")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise PromptShapeError(f"{part_path}.type must be a string")
        field = text_fields.get(kind)
        if field is not None:
            total += counter.count(require_text(part.get(field), f"{part_path}.{field}"))
        elif kind in IMAGE_PARTS:
            total += spec.image_tokens
        elif kind in AUDIO_PARTS:
            total += spec.audio_tokens
        elif kind in FILE_PARTS:
            inline = part.get("text") if inline_file_text else None
            total += counter.count(inline) if isinstance(inline, str) else spec.file_tokens
        else:
            total += counter.count(json_text(part))
    return total
