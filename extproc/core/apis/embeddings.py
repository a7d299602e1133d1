"""OpenAI's embeddings (``POST /v1/embeddings``).

**Request.** ``model`` and ``input``: a string, a list of strings, a list of token ids or a list
of token-id lists; nothing empty (an empty string, list or token-id list is a 400 naming
``input``, as OpenAI does).  Strings are counted with the model's tokenizer, token ids by how
many there are; no framing overhead.

**No output.** An embedding generates no tokens: ``sequences`` is 0 and the declared budget
0, so admission reserves nothing beyond the input (``sequences * budget`` is 0 whichever of
the two admission multiplies by), and ``rewrite`` adds no budget field.  The response is one
JSON object; its ``usage.prompt_tokens`` settles the request.

**Never a stream** (``can_stream`` is False; a ``stream`` field is not part of the API and is
ignored).  :meth:`EmbeddingsFormat.stream_reader` still returns a reader, one that refuses
every event as :class:`MalformedChunk` (a metering loop that met one would count its bytes
rather than let it pass free), and :meth:`EmbeddingsFormat.cut_events` renders the OpenAI
in-stream error event; neither is used on this path.  Errors are OpenAI-shaped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.core.apis.base import ApiName, ParsedRequest, RequestLimits
from extproc.core.apis.common import json_object, require_model, rewrite_fields, usage_of_json
from extproc.core.apis.errors import error_body, error_headers, sse_error_event
from extproc.core.apis.reassembly import BufferedStream
from extproc.core.chunks import MalformedChunk, StreamChunk, Usage
from extproc.core.tokens import PromptShapeError, TokenCounter, TokenizerSpec
from extproc.core.values import is_int
from extproc.errors import BadRequest, GatewayError

__all__ = ["EMBEDDINGS", "EmbeddingsFormat", "count_embeddings_input", "embeddings_usage"]

_SHAPE = (
    "'input' must be a non-empty string, a non-empty array of non-empty strings, "
    "a non-empty array of token ids or a non-empty array of non-empty token-id arrays"
)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _check_input(value: object) -> None:
    if isinstance(value, str):
        if value:
            return
        raise BadRequest("'input' must not be an empty string", param="input")
    if not isinstance(value, list) or not value:
        raise BadRequest(_SHAPE, param="input")
    if all(isinstance(v, str) for v in value):
        if all(value):
            return
        raise BadRequest("'input' must not contain empty strings", param="input")
    if _token_ids(value) or all(_token_ids(v) for v in value):
        return
    raise BadRequest(_SHAPE, param="input")


def count_embeddings_input(body: Mapping[str, Any], counter: TokenCounter) -> int:
    """Tokens of ``input``: strings counted, token ids by their number (no overhead)."""
    value = body.get("input")
    if isinstance(value, str):
        return counter.count(value)
    if not isinstance(value, list):
        raise PromptShapeError("input must be a string or a list")
    if _token_ids(value):
        return len(value)
    total = 0
    for i, item in enumerate(value):
        if isinstance(item, str):
            total += counter.count(item)
        elif _token_ids(item):
            total += len(item)
        else:
            raise PromptShapeError(f"input[{i}] must be a string or a list of token ids")
    return total


def embeddings_usage(value: object) -> Usage | None:
    """``usage`` of an embeddings response (``prompt_tokens``; no completion)."""
    if not isinstance(value, Mapping):
        return None
    prompt = value.get("prompt_tokens")
    if not (isinstance(prompt, int) and is_int(prompt)):
        return None
    total = value.get("total_tokens")
    return Usage(prompt, 0, total if isinstance(total, int) and is_int(total) else prompt)


class _NoStream:
    """The reader of a stream that must not exist: every event is malformed."""

    __slots__ = ()

    def read(self, event: str | None, data: str) -> StreamChunk:
        raise MalformedChunk("an embeddings response is not an event stream")


_NO_STREAM = _NoStream()


class EmbeddingsFormat:
    """``POST /v1/embeddings``: input only, one JSON response, OpenAI-shaped errors."""

    can_stream = False

    def __init__(self) -> None:
        self.name: ApiName = "embeddings"

    def parse(self, raw: bytes, limits: RequestLimits) -> ParsedRequest:
        """Validate ``model`` and ``input``."""
        body = json_object(raw)
        model = require_model(body)
        if "input" not in body or body["input"] is None:
            raise BadRequest("'input' is required", param="input")
        _check_input(body["input"])
        return ParsedRequest(
            api="embeddings",
            model=model,
            stream=False,
            sequences=0,
            declared_max_output=0,
            body=body,
            client_include_usage=True,
            budget_fields=(),
        )

    def count_input(self, req: ParsedRequest, counter: TokenCounter, spec: TokenizerSpec) -> int:
        """Input tokens (``spec``'s framing figures do not apply)."""
        return count_embeddings_input(req.body, counter)

    def rewrite(
        self,
        req: ParsedRequest,
        *,
        budget: int | None,
        force_usage: bool,
        model: str | None,
        continuous_usage: bool = False,
        upstream_stream: bool = False,
        stream_interval: int | None = None,
    ) -> bytes | None:
        """Only the canonical model: there is no output budget to write."""
        return rewrite_fields(req, budget=None, model=model)

    def reassembles(self, req: ParsedRequest) -> bool:
        """Never: an embedding generates nothing, its usage is its input."""
        return False

    def reassembler(self) -> BufferedStream:
        """Not asked (:meth:`reassembles` is False)."""
        raise TypeError("embeddings are never sent upstream as a stream")

    def stream_reader(self) -> _NoStream:
        """A reader refusing every event (never used: embeddings do not stream)."""
        return _NO_STREAM

    def json_usage(self, body: bytes) -> Usage | None:
        """``usage.prompt_tokens`` of the response."""
        return usage_of_json(body, embeddings_usage)

    def error_body(self, err: GatewayError) -> bytes:
        """OpenAI's ``{"error": {...}}``."""
        return error_body(err)

    def error_headers(self, err: GatewayError) -> list[tuple[str, str]]:
        """As for chat completions."""
        return error_headers(err)

    def cut_events(self, err: GatewayError) -> bytes:
        """OpenAI's in-stream error event (never used: embeddings do not stream)."""
        return sse_error_event(err.message, error_type=err.error_type, code=err.code)


EMBEDDINGS = EmbeddingsFormat()
