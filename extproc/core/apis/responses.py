"""OpenAI's Responses API (``POST /v1/responses``).

**Request.** ``model``; ``input`` (a string, or a list of items); ``instructions``; ``tools``;
``text.format`` (a JSON schema); ``max_output_tokens`` (the output budget: an integer from 1
to the ceiling, ``10.0`` read as 10 and forwarded as an int); ``stream``. The API has no
``n``: one output sequence per request (an ``n`` other than 1 is refused, so the reservation
can never be too small for an upstream that would honour it).

**Input the gateway cannot see.** ``previous_response_id``, ``conversation`` and ``prompt``
(a stored prompt template) make the upstream prepend state it keeps itself; ``item_reference``
items point at stored items. None of that is in the body, so it is not counted at admission:
``ParsedRequest.notes["previous_response_id"]`` carries the id and ``notes["unseen_input"]``
names every such field present.  Settlement still charges the upstream's reported
``usage.input_tokens``, which includes them.

**Counting** (with the model's tokenizer, and the spec's chat framing figures):

* ``instructions``: ``tokens_per_message`` + its text;
* a string ``input``: ``tokens_per_message`` + its text;
* a message item (``type: "message"`` or no type with a ``role``): ``tokens_per_message`` +
  role + content (a string, or parts: ``input_text``/``output_text`` text, ``refusal`` text,
  ``input_image`` a flat ``spec.image_tokens`` (765 by default) whatever its URL or detail,
  ``input_file`` a flat ``spec.file_tokens`` unless it carries inline text, ``input_audio``
  ``spec.audio_tokens``, any other part its compact JSON);
* ``function_call``: ``tokens_per_message`` + name + arguments; ``function_call_output``:
  ``tokens_per_message`` + its output (a string or content parts);
* ``reasoning``: ``tokens_per_message`` + summary and content texts + ``encrypted_content``
  (counted as text: opaque, but over-counting is the safe direction);
* any other item (tool calls of built-in tools, ``item_reference`` ...): ``tokens_per_message``
  + its compact JSON;
* ``tools`` and a ``text.format`` JSON schema by their compact JSON; ``reply_priming_tokens``
  once.

**Stream.** SSE events with ``event:`` names and JSON data whose ``type`` repeats the name.
Output tokens come from the ``delta`` of ``response.output_text.delta``,
``response.refusal.delta``, ``response.reasoning_text.delta``,
``response.reasoning_summary_text.delta``, ``response.function_call_arguments.delta`` and
``response.custom_tool_call_input.delta``, with ``output_index`` as the choice index (the
``*.done`` events repeat the full text and are not counted).  ``response.completed``,
``response.incomplete`` and ``response.failed`` end the stream (``done``) and carry the usage
in ``response.usage``; there is no ``data: [DONE]``.  An ``error`` event becomes
``chunk.error``.

**Cut.** The stream's own ``error`` event (see :meth:`ResponsesFormat.cut_events`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from extproc.core.apis.base import ApiName, ParsedRequest, RequestLimits
from extproc.core.apis.common import (
    count_content_parts,
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
    error_body,
    error_headers,
    passed_error,
    responses_cut_event,
)
from extproc.core.apis.reassembly import BufferedStream, Event
from extproc.core.chat_template import count_with_template
from extproc.core.chunks import MalformedChunk, StreamChunk, Usage, detail
from extproc.core.tokens import PromptShapeError, TokenCounter, TokenizerSpec, require_text
from extproc.core.values import is_int
from extproc.errors import BadRequest, GatewayError

__all__ = ["RESPONSES", "ResponsesFormat", "ResponsesReader", "responses_usage"]

BUDGET_FIELD: Final = "max_output_tokens"
#: Fields whose content the upstream adds to the input without the gateway seeing it.
UNSEEN_INPUT_FIELDS: Final = ("previous_response_id", "conversation", "prompt")

#: Event types whose ``delta`` is output text.
DELTA_EVENTS: Final = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    }
)
#: Event types that end the stream with the final response object (and its usage).
TERMINAL_EVENTS: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})

_TEXT_PARTS: Final = {
    "input_text": "text",
    "output_text": "text",
    "text": "text",
    "summary_text": "text",
    "reasoning_text": "text",
    "refusal": "refusal",
}


# --------------------------------------------------------------------------- counting


def _count_parts(content: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    """A message ``content`` or a ``function_call_output.output``: a string or a list of parts."""
    return count_content_parts(
        content,
        path,
        counter,
        spec,
        text_fields=_TEXT_PARTS,
        shape="a string or a list of content parts",
        inline_file_text=True,
    )


def _count_item(item: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    if isinstance(item, str):  # lenient: a bare string in the list reads as user text
        return spec.tokens_per_message + counter.count(item)
    if not isinstance(item, Mapping):
        raise PromptShapeError(f"{path} must be an object")
    kind = item.get("type")
    if kind is not None and not isinstance(kind, str):
        raise PromptShapeError(f"{path}.type must be a string")
    total = spec.tokens_per_message
    if kind == "message" or (kind is None and "role" in item):
        role = item.get("role")
        if role is not None:
            total += counter.count(require_text(role, f"{path}.role"))
        return total + _count_parts(item.get("content"), f"{path}.content", counter, spec)
    if kind == "function_call":
        name = item.get("name")
        if name is not None:
            total += counter.count(require_text(name, f"{path}.name"))
        arguments = item.get("arguments")
        if isinstance(arguments, str):
            total += counter.count(arguments)
        elif arguments is not None:
            total += counter.count(json_text(arguments))
        return total
    if kind == "function_call_output":
        return total + _count_parts(item.get("output"), f"{path}.output", counter, spec)
    if kind == "reasoning":
        for key in ("summary", "content"):
            value = item.get(key)
            if value is not None:
                total += _count_parts(value, f"{path}.{key}", counter, spec)
        encrypted = item.get("encrypted_content")
        if isinstance(encrypted, str):
            total += counter.count(encrypted)
        return total
    return total + counter.count(json_text(item))


def count_responses_input(
    body: Mapping[str, Any], counter: TokenCounter, spec: TokenizerSpec
) -> int:
    """Input tokens of a ``/v1/responses`` body (see the module docstring); raises
    :class:`PromptShapeError` naming the field that has the wrong shape."""
    total = spec.reply_priming_tokens
    instructions = body.get("instructions")
    if instructions is not None:
        total += spec.tokens_per_message + counter.count(require_text(instructions, "instructions"))
    items = body.get("input")
    if isinstance(items, str):
        total += spec.tokens_per_message + counter.count(items)
    elif isinstance(items, list):
        for i, item in enumerate(items):
            total += _count_item(item, f"input[{i}]", counter, spec)
    elif items is not None:
        raise PromptShapeError("input must be a string or a list of items")
    tools = body.get("tools")
    if tools:
        total += counter.count(json_text(tools))
    text = body.get("text")
    if isinstance(text, Mapping):
        fmt = text.get("format")
        if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
            total += counter.count(json_text(fmt))
    return total


# --------------------------------------------------------------------------- usage


def responses_usage(value: object) -> Usage | None:
    """A Responses ``usage`` object as :class:`Usage`, None unless both counts are ints."""
    if not isinstance(value, dict):
        return None
    prompt = value.get("input_tokens")
    completion = value.get("output_tokens")
    if not (isinstance(prompt, int) and is_int(prompt)):
        return None
    if not (isinstance(completion, int) and is_int(completion)):
        return None
    total = value.get("total_tokens")
    if not (isinstance(total, int) and is_int(total)):
        total = prompt + completion
    return Usage(
        prompt,
        completion,
        total,
        cached_input_tokens=detail(value, "input_tokens_details", "cached_tokens"),
        reasoning_tokens=detail(value, "output_tokens_details", "reasoning_tokens"),
    )


def _load_event(data: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MalformedChunk(f"event data is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedChunk(f"event data is a JSON {type(obj).__name__}, not an object")
    return obj


class ResponsesReader:
    """Reads one Responses stream.  Keeps the last ``sequence_number`` seen, so a cut can
    continue the numbering (:meth:`ResponsesFormat.cut_events`)."""

    __slots__ = ("last_sequence_number",)

    def __init__(self) -> None:
        self.last_sequence_number: int | None = None

    def read(self, event: str | None, data: str) -> StreamChunk:
        """The chunk for one event; ``MalformedChunk`` when the data is not a JSON object."""
        obj = _load_event(data)
        seq = obj.get("sequence_number")
        if isinstance(seq, int) and is_int(seq):
            self.last_sequence_number = seq
        kind = obj.get("type")
        if not isinstance(kind, str):
            kind = event or ""
        chunk = StreamChunk()
        if kind in DELTA_EVENTS:
            delta = obj.get("delta")
            if isinstance(delta, str) and delta:
                index = obj.get("output_index")
                chunk.texts.append(
                    (index if isinstance(index, int) and is_int(index) else 0, delta)
                )
        elif kind in TERMINAL_EVENTS:
            chunk.done = True
            response = obj.get("response")
            if isinstance(response, dict):
                chunk.usage = responses_usage(response.get("usage"))
                status = response.get("status")
                reason = status if isinstance(status, str) else kind.rsplit(".", 1)[1]
                details = response.get("incomplete_details")
                if isinstance(details, dict) and isinstance(details.get("reason"), str):
                    reason = details["reason"]
                chunk.finish_reasons.append((0, reason))
                if kind == "response.failed" and isinstance(response.get("error"), dict):
                    chunk.error = response["error"]
        elif kind == "error":
            err = obj.get("error")
            if isinstance(err, dict):
                chunk.error = err
            else:
                chunk.error = {
                    k: obj[k] for k in ("code", "message", "param") if obj.get(k) is not None
                }
        return chunk


class ResponsesFormat:
    """``POST /v1/responses``: OpenAI-shaped errors, typed SSE events, no ``[DONE]``."""

    can_stream = True

    def __init__(self) -> None:
        self.name: ApiName = "responses"

    def parse(self, raw: bytes, limits: RequestLimits) -> ParsedRequest:
        """Validate the top-level fields (deep shapes are checked while counting)."""
        body = json_object(raw)
        model = require_model(body)
        items = body.get("input")
        if items is not None and not isinstance(items, str | list):
            raise BadRequest("'input' must be a string or an array of input items", param="input")
        if isinstance(items, list):
            for i, item in enumerate(items):
                if not isinstance(item, dict | str):
                    raise BadRequest(f"'input[{i}]' must be an object", param="input")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        object_list(body, "tools")
        stream = optional_bool(body, "stream")
        notes: dict[str, Any] = {}
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise BadRequest(
                "'n' is not supported by the Responses API (one output per request)", param="n"
            )
        declared = int_field(
            body, BUDGET_FIELD, minimum=1, ceiling=limits.max_tokens_ceiling, notes=notes
        )
        unseen = tuple(f for f in UNSEEN_INPUT_FIELDS if body.get(f) is not None)
        if unseen:
            notes["unseen_input"] = unseen
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise BadRequest(
                    "'previous_response_id' must be a string", param="previous_response_id"
                )
            notes["previous_response_id"] = previous
        return ParsedRequest(
            api="responses",
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
        n = count_with_template("responses", req.body, counter, spec)
        return n if n is not None else count_responses_input(req.body, counter, spec)

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
        """Canonical model and ``max_output_tokens`` = budget when absent or larger.
        ``force_usage`` is moot: the terminal event always carries usage."""
        return rewrite_fields(req, budget=budget, model=model, upstream_stream=upstream_stream)

    def stream_reader(self) -> ResponsesReader:
        """A fresh reader (it remembers the sequence number)."""
        return ResponsesReader()

    def reassembles(self, req: ParsedRequest) -> bool:
        """Always: the stream's terminal event carries the whole response object."""
        return True

    def reassembler(self) -> BufferedStream:
        """A fresh reassembler (:func:`assemble_response`)."""
        return BufferedStream(assemble_response)

    def json_usage(self, body: bytes) -> Usage | None:
        """``usage`` of a non-streaming response object."""
        return usage_of_json(body, responses_usage)

    def error_body(self, err: GatewayError) -> bytes:
        """``{"error": {message, type, param, code}}``, as for chat completions."""
        return error_body(err)

    def error_headers(self, err: GatewayError) -> list[tuple[str, str]]:
        """Content type, ``retry-after``/``retry-after-ms`` and ``x-ratelimit-*`` on a 429."""
        return error_headers(err)

    def cut_events(self, err: GatewayError, *, sequence_number: int | None = None) -> bytes:
        """The Responses stream's ``error`` event, and nothing after it.

        The data has the documented top-level ``type: "error"``, ``code``, ``message``,
        ``param`` and ``sequence_number`` (one past ``sequence_number``, the reader's
        ``last_sequence_number``, when given; else 0), plus an ``error`` object with the same
        message: the openai SDK raises ``APIError`` for stream data carrying a non-empty
        ``error`` and would otherwise yield a plain ``ResponseErrorEvent`` and carry on.  No
        ``data: [DONE]``: the Responses API never sends one and the SDK needs none.  Rendered by
        :func:`~extproc.core.apis.errors.responses_cut_event`."""
        return responses_cut_event(err, sequence_number=sequence_number)


def assemble_response(events: list[Event]) -> dict[str, Any]:
    """The response object of a Responses stream (the exact path): the last event carrying one
    (``response.completed``, ``response.incomplete`` or ``response.failed``: the whole object;
    before those, ``response.created``/``in_progress``), or the stream's ``error`` event as an
    error body."""
    found: dict[str, Any] | None = None
    for _, obj in events:
        if obj.get("type") == "error":
            err = obj.get("error")
            if not isinstance(err, dict):
                err = {k: obj.get(k) for k in ("message", "code", "param")} | {"type": "error"}
            return passed_error(err)
        response = obj.get("response")
        if isinstance(response, dict):
            found = response
    return found if found is not None else {}


RESPONSES = ResponsesFormat()
