"""Anthropic's Messages API (``POST /v1/messages``), as vLLM and SGLang serve it for open models.

**Request.** ``model``; ``max_tokens`` (required by this API: a missing one is a 400 in
Anthropic's error shape; an integer from 1 to the ceiling, ``10.0`` read as 10 and forwarded
as an int); ``system`` (a string or text blocks); ``messages`` (a non-empty list of ``role`` +
``content``, a string or blocks); ``tools``; ``stream``.  One output sequence per request.
The API documents the key in ``x-api-key``; the anthropic Python SDK 2.x sends it as
``authorization: Bearer`` instead, so both must be accepted.

**Counting** with the model's tokenizer and the spec's chat framing figures (the same small,
documented overhead as chat completions: ``tokens_per_message`` per message and for a system
prompt, ``reply_priming_tokens`` once):

* ``text`` blocks their text; ``image`` blocks a flat ``spec.image_tokens`` (765 by default)
  whatever their source;
* ``tool_use``: name + the compact JSON of ``input``; ``tool_result``: its content (a string
  or blocks);
* ``thinking`` its text; ``redacted_thinking`` its opaque ``data`` counted as text (an
  over-count, the safe direction);
* ``document``: a ``text`` source its data, a ``content`` source its blocks, any other source
  (a PDF, a URL, a file id) a flat ``spec.file_tokens``; plus ``title`` and ``context``;
* any other block its compact JSON;
* ``tools`` by their compact JSON.

**Stream.** SSE events with ``event:`` names.  ``message_start`` carries the input figures
(``input_tokens``, ``cache_read_input_tokens``, ``cache_creation_input_tokens``), which the
reader keeps; ``content_block_delta`` output text (``text_delta.text``,
``input_json_delta.partial_json``, ``thinking_delta.thinking``; a ``signature_delta`` is not
model text); every block belongs to the one output sequence, choice 0.  ``message_delta``
carries the cumulative ``usage.output_tokens`` (and, from some servers, updated input
figures) and the ``stop_reason``: its chunk has the :class:`Usage`, the last one wins.
``message_stop`` ends the stream (``done``).  ``ping`` is ignored; ``error`` becomes
``chunk.error`` (the stream ends after it without ``message_stop``).

**Errors** are ``{"type": "error", "error": {"type", "message"}}``.  A 429 carries
``retry-after`` (whole seconds, the same rounding as the OpenAI formats) and
``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}``;
the ``*-reset`` values are RFC 3339 UTC instants, which need the current time: the format
takes a :class:`~extproc.clock.Clock` at construction (:meth:`MessagesFormat.with_clock`) or
``now_ms`` per call, and leaves the reset headers out when it has neither (the module-level
:data:`MESSAGES` has no clock).  The gateway's token limits count input and output together,
so the ``input-tokens`` and ``output-tokens`` families repeat the ``tokens`` bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import orjson

from extproc.core.apis.base import ApiName, ParsedRequest, RequestLimits
from extproc.core.apis.common import (
    int_field,
    json_object,
    json_text,
    object_list,
    optional_bool,
    require_model,
    rewrite_fields,
    usage_of_json,
)
from extproc.core.apis.errors import (
    anthropic_cut_event,
    anthropic_error_body,
    anthropic_error_headers,
    anthropic_error_type,
    passed_anthropic_error,
)
from extproc.core.apis.reassembly import BufferedStream, Event, concat
from extproc.core.chat_template import count_with_template
from extproc.core.chunks import MalformedChunk, StreamChunk, Usage
from extproc.core.tokens import PromptShapeError, TokenCounter, TokenizerSpec, require_text
from extproc.core.values import is_int
from extproc.errors import BadRequest, GatewayError, QuotaExceeded

if TYPE_CHECKING:
    from extproc.clock import Clock

__all__ = [
    "MESSAGES",
    "MessagesFormat",
    "MessagesReader",
    "anthropic_error_type",
    "count_messages_input",
    "messages_usage",
]

BUDGET_FIELD: Final = "max_tokens"

_TEXT_DELTAS: Final = {
    "text_delta": "text",
    "input_json_delta": "partial_json",
    "thinking_delta": "thinking",
}


# --------------------------------------------------------------------------- counting


def _count_blocks(content: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    """A ``content`` (or ``system``, or ``tool_result.content``): a string or a list of blocks."""
    if content is None:
        return 0
    if isinstance(content, str):
        return counter.count(content)
    if not isinstance(content, list):
        raise PromptShapeError(f"{path} must be a string or a list of content blocks")
    return sum(
        _count_block(block, f"{path}[{i}]", counter, spec) for i, block in enumerate(content)
    )


def _count_block(block: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    if not isinstance(block, Mapping):
        raise PromptShapeError(f"{path} must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise PromptShapeError(f"{path}.type must be a string")
    if kind == "text":
        return counter.count(require_text(block.get("text"), f"{path}.text"))
    if kind == "image":
        return spec.image_tokens
    if kind == "tool_use":
        total = 0
        name = block.get("name")
        if name is not None:
            total += counter.count(require_text(name, f"{path}.name"))
        value = block.get("input")
        if value is not None:
            total += counter.count(value if isinstance(value, str) else json_text(value))
        return total
    if kind == "tool_result":
        return _count_blocks(block.get("content"), f"{path}.content", counter, spec)
    if kind == "thinking":
        return counter.count(require_text(block.get("thinking"), f"{path}.thinking"))
    if kind == "redacted_thinking":
        data = block.get("data")
        return counter.count(data) if isinstance(data, str) else 0
    if kind == "document":
        return _count_document(block, path, counter, spec)
    return counter.count(json_text(block))


def _count_document(
    block: Mapping[str, Any], path: str, counter: TokenCounter, spec: TokenizerSpec
) -> int:
    total = 0
    for key in ("title", "context"):
        value = block.get(key)
        if isinstance(value, str):
            total += counter.count(value)
    source = block.get("source")
    if isinstance(source, Mapping) and source.get("type") == "text":
        return total + counter.count(require_text(source.get("data"), f"{path}.source.data"))
    if isinstance(source, Mapping) and source.get("type") == "content":
        return total + _count_blocks(source.get("content"), f"{path}.source.content", counter, spec)
    return total + spec.file_tokens


def count_messages_input(
    body: Mapping[str, Any], counter: TokenCounter, spec: TokenizerSpec
) -> int:
    """Input tokens of a ``/v1/messages`` body (see the module docstring); raises
    :class:`PromptShapeError` naming the field that has the wrong shape."""
    total = spec.reply_priming_tokens
    system = body.get("system")
    if system is not None:
        total += spec.tokens_per_message + _count_blocks(system, "system", counter, spec)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise PromptShapeError("messages must be a list")
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise PromptShapeError(f"{path} must be an object")
        total += spec.tokens_per_message
        role = message.get("role")
        if role is not None:
            total += counter.count(require_text(role, f"{path}.role"))
        total += _count_blocks(message.get("content"), f"{path}.content", counter, spec)
    tools = body.get("tools")
    if tools:
        total += counter.count(json_text(tools))
    return total


# --------------------------------------------------------------------------- usage


def _count_field(usage: Mapping[str, Any], name: str) -> int | None:
    v = usage.get(name)
    return v if isinstance(v, int) and is_int(v) and v >= 0 else None


def messages_usage(value: object) -> Usage | None:
    """An Anthropic ``usage`` object as :class:`Usage` (prompt = input + cache reads + cache
    writes; cached = cache reads), None unless ``input_tokens`` and ``output_tokens`` are ints."""
    if not isinstance(value, Mapping):
        return None
    uncached = _count_field(value, "input_tokens")
    output = _count_field(value, "output_tokens")
    if uncached is None or output is None:
        return None
    read = _count_field(value, "cache_read_input_tokens") or 0
    created = _count_field(value, "cache_creation_input_tokens") or 0
    prompt = uncached + read + created
    return Usage(prompt, output, prompt + output, cached_input_tokens=read)


class MessagesReader:
    """Reads one Messages stream; keeps the input figures of ``message_start`` for the usage
    that ``message_delta`` completes."""

    __slots__ = ("_input",)

    def __init__(self) -> None:
        self._input: dict[str, int] = {}

    def _remember(self, usage: object) -> None:
        if isinstance(usage, Mapping):
            for name in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
                v = _count_field(usage, name)
                if v is not None:
                    self._input[name] = v

    def read(self, event: str | None, data: str) -> StreamChunk:
        """The chunk for one event; ``MalformedChunk`` when the data is not a JSON object."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise MalformedChunk(f"event data is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise MalformedChunk(f"event data is a JSON {type(obj).__name__}, not an object")
        kind = obj.get("type")
        if not isinstance(kind, str):
            kind = event or ""
        chunk = StreamChunk()
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, Mapping):
                field = _TEXT_DELTAS.get(str(delta.get("type")))
                text = delta.get(field) if field is not None else None
                if isinstance(text, str) and text:
                    chunk.texts.append((0, text))
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, Mapping):  # normally empty; count whatever text a server puts
                for field in ("text", "thinking"):
                    text = block.get(field)
                    if isinstance(text, str) and text:
                        chunk.texts.append((0, text))
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, Mapping):
                self._remember(message.get("usage"))
        elif kind == "message_delta":
            usage = obj.get("usage")
            if isinstance(usage, Mapping):
                self._remember(usage)
                output = _count_field(usage, "output_tokens")
                if output is not None and "input_tokens" in self._input:
                    chunk.usage = messages_usage({**self._input, "output_tokens": output})
            delta = obj.get("delta")
            if isinstance(delta, Mapping) and isinstance(delta.get("stop_reason"), str):
                chunk.finish_reasons.append((0, delta["stop_reason"]))
        elif kind == "message_stop":
            chunk.done = True
        elif kind == "error":
            err = obj.get("error")
            chunk.error = dict(err) if isinstance(err, Mapping) else {"message": str(err)}
        return chunk


class MessagesFormat:
    """``POST /v1/messages``: Anthropic-shaped errors and events, no ``[DONE]``."""

    can_stream = True

    def __init__(self, clock: Clock | None = None) -> None:
        """``clock`` gives the current time for the ``*-reset`` headers (None: left out)."""
        self.name: ApiName = "messages"
        self.clock = clock

    def with_clock(self, clock: Clock) -> MessagesFormat:
        """The same format reading ``clock`` for the reset headers."""
        return MessagesFormat(clock)

    def parse(self, raw: bytes, limits: RequestLimits) -> ParsedRequest:
        """Validate the top-level fields (deep shapes are checked while counting)."""
        body = json_object(raw)
        model = require_model(body)
        notes: dict[str, Any] = {}
        declared = int_field(
            body,
            BUDGET_FIELD,
            minimum=1,
            ceiling=limits.max_tokens_ceiling,
            notes=notes,
            required=True,
        )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                "'messages' is required and must be a non-empty array", param="messages"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequest(f"'messages[{i}]' must be an object", param="messages")
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise BadRequest("'system' must be a string or an array of text blocks", param="system")
        object_list(body, "tools")
        stream = optional_bool(body, "stream")
        return ParsedRequest(
            api="messages",
            model=model,
            stream=stream,
            sequences=1,
            declared_max_output=declared,
            body=body,
            client_include_usage=True,
            budget_fields=(BUDGET_FIELD,),
            notes=notes,
        )

    def count_input(self, req: ParsedRequest, counter: TokenCounter, spec: TokenizerSpec) -> int:
        """Input tokens: the model's chat template rendered when it has one and the body
        renders, else the framing formula (see the module docstring)."""
        n = count_with_template("messages", req.body, counter, spec)
        return n if n is not None else count_messages_input(req.body, counter, spec)

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
        """Canonical model and ``max_tokens`` lowered to the budget.  ``force_usage`` is moot:
        ``message_start``/``message_delta`` always carry usage."""
        return rewrite_fields(req, budget=budget, model=model, upstream_stream=upstream_stream)

    def stream_reader(self) -> MessagesReader:
        """A fresh reader (it keeps the ``message_start`` input figures)."""
        return MessagesReader()

    def reassembles(self, req: ParsedRequest) -> bool:
        """Always (:func:`assemble_message`)."""
        return True

    def reassembler(self) -> BufferedStream:
        """A fresh reassembler (:func:`assemble_message`)."""
        return BufferedStream(assemble_message)

    def json_usage(self, body: bytes) -> Usage | None:
        """``usage`` of a non-streaming message object."""
        return usage_of_json(body, messages_usage)

    def error_body(self, err: GatewayError) -> bytes:
        """``{"type": "error", "error": {"type", "message"}}``."""
        return anthropic_error_body(err)

    def error_headers(
        self, err: GatewayError, *, now_ms: int | None = None
    ) -> list[tuple[str, str]]:
        """Content type; on a 429 ``retry-after`` and the ``anthropic-ratelimit-*`` headers
        (``*-reset`` only when ``now_ms`` is given or the format has a clock); on a 503
        ``retry-after: 1``."""
        if now_ms is None and self.clock is not None and isinstance(err, QuotaExceeded):
            now_ms = self.clock.now_ms()
        return anthropic_error_headers(err, now_ms=now_ms)

    def cut_events(self, err: GatewayError) -> bytes:
        """``event: error`` with the Anthropic error object; the SDKs raise on it.  Nothing
        follows (no ``message_stop``, no ``[DONE]``)."""
        return anthropic_cut_event(err)


def _block_delta(
    block: dict[str, Any], delta: dict[str, Any], partial: dict[int, list[str]], i: int
) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        concat(block, "text", delta.get("text"))
    elif kind == "input_json_delta":
        if isinstance(delta.get("partial_json"), str):
            partial.setdefault(i, []).append(delta["partial_json"])
    elif kind == "thinking_delta":
        concat(block, "thinking", delta.get("thinking"))
    elif kind == "signature_delta":
        concat(block, "signature", delta.get("signature"))
    elif kind == "citations_delta" and isinstance(delta.get("citation"), dict):
        block.setdefault("citations", []).append(delta["citation"])


def assemble_message(events: list[Event]) -> dict[str, Any]:
    """The ``message`` of a Messages stream (the exact path): ``message_start``'s message, its
    content blocks by ``index`` (text and thinking deltas concatenated, a tool's
    ``input_json_delta`` pieces joined and parsed as its ``input``, signatures and citations
    kept), ``message_delta``'s stop reason and sequence, and its usage over the start's; the
    stream's ``error`` event becomes the error body."""
    msg: dict[str, Any] = {"type": "message", "role": "assistant", "content": []}
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, list[str]] = {}
    for _, obj in events:
        kind = obj.get("type")
        if kind == "error":
            return passed_anthropic_error(obj.get("error"))
        index = obj.get("index")
        i = index if isinstance(index, int) and is_int(index) else 0
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            msg = dict(obj["message"])
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            blocks[i] = dict(obj["content_block"])
        elif kind == "content_block_delta" and isinstance(obj.get("delta"), dict):
            _block_delta(blocks.setdefault(i, {}), obj["delta"], partial, i)
        elif kind == "message_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                msg.update(delta)
            usage = obj.get("usage")
            if isinstance(usage, dict):
                old = msg.get("usage")
                have: dict[str, Any] = old if isinstance(old, dict) else {}
                msg["usage"] = have | {k: v for k, v in usage.items() if v is not None}
    for i, pieces in partial.items():
        text = "".join(pieces)
        try:
            blocks[i]["input"] = orjson.loads(text) if text else {}
        except orjson.JSONDecodeError:  # a tool input cut short: its text, unparsed
            blocks[i]["input"] = {}
    msg["content"] = [blocks[k] for k in sorted(blocks)]
    return msg


MESSAGES = MessagesFormat()
