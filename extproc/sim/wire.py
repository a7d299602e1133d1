"""Wire formats of the simulator's generation APIs (pure: bytes and dicts, no I/O).

One encoder per API turns the same generated output (reasoning, answer text or tool arguments,
per choice) into that API's events and bodies:

* ``chat``: OpenAI ``chat.completion`` / ``chat.completion.chunk`` (``data:`` lines, ``[DONE]``);
* ``completions``: OpenAI ``text_completion``;
* ``responses``: OpenAI Responses API (typed events with ``event:`` lines and ``sequence_number``);
* ``messages``: Anthropic Messages API (``event:`` lines, ``message_start`` … ``message_stop``).

Stream encoders are stateful: ``delta`` emits the events that open or close output items or
content blocks when the kind of output changes (reasoning → text, …).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from extproc.sim.text import count_tokens

TOOL_NAME = "sim_tool"
MALFORMED_DATA = b"data: {not json\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
INJECTED_ERROR_MESSAGE = "injected in-stream error (x-sim-error-event-after)"

#: Anthropic tool_use input is JSON: the token-exact text is wrapped as {"text": "<text>"}
TOOL_JSON_PREFIX = '{"text": "'
TOOL_JSON_SUFFIX = '"}'

REASONING = "reasoning"
CONTENT = "content"
TOOL = "tool"

APIS: tuple[str, ...] = ("chat", "completions", "responses", "messages", "embeddings")


def sse(obj: Any) -> bytes:
    """One ``data:`` event."""
    return b"data: " + bytes(orjson.dumps(obj)) + b"\n\n"


def typed_sse(event: str, obj: Any) -> bytes:
    """One event with an ``event:`` line (Responses and Anthropic streams)."""
    return b"event: " + event.encode() + b"\ndata: " + bytes(orjson.dumps(obj)) + b"\n\n"


@dataclass(frozen=True, slots=True)
class Unit:
    """A piece of output: ``tokens`` output tokens of one kind (reasoning, content, tool)."""

    text: str
    tokens: int
    kind: str


@dataclass(frozen=True, slots=True)
class WireContext:
    """What every encoder needs to know about the request being answered."""

    sim_id: str
    model: str
    created: int
    prompt_tokens: int
    include_usage: bool
    #: chat-style finish reason of the plan: stop | length | tool_calls
    finish_reason: str
    choices: int
    tool: bool
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class UsageReport:
    """The usage to send: ``output`` is the reported count (None = omit usage)."""

    output: int | None
    reasoning: int


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """Complete output of one choice, for non-streaming bodies."""

    index: int
    reasoning: str
    answer: str


def tool_json_units(pieces: list[str]) -> list[Unit]:
    """Anthropic tool arguments: ``pieces`` wrapped into a JSON object, token counts exact.

    The pieces must start with a space-led piece so that the prefix cannot merge with them
    (``generate_pieces`` always starts that way); the wrapper parts are counted on their own.
    """
    return [
        Unit(TOOL_JSON_PREFIX, count_tokens(TOOL_JSON_PREFIX), TOOL),
        *(Unit(p, 1, TOOL) for p in pieces),
        Unit(TOOL_JSON_SUFFIX, count_tokens(TOOL_JSON_SUFFIX), TOOL),
    ]


def tool_json_overhead() -> int:
    """Tokens the Anthropic tool-input wrapper adds."""
    return count_tokens(TOOL_JSON_PREFIX) + count_tokens(TOOL_JSON_SUFFIX)


class Encoder:
    """Base class: the API-specific pieces of a response."""

    api = ""

    def __init__(self, ctx: WireContext) -> None:
        self.ctx = ctx

    def opening(self) -> list[bytes]:
        """Events sent right after the time to first token."""
        return []

    def delta(self, choice: int, text: str, kind: str) -> list[bytes]:
        """Events carrying ``text`` of ``kind`` for ``choice`` (the last one carries the text)."""
        raise NotImplementedError

    def closing(self, usage: UsageReport) -> list[bytes]:
        """Events after the last token (finish, usage, terminator)."""
        raise NotImplementedError

    def error_event(self) -> bytes:
        """The injected in-stream error event."""
        return sse(
            {
                "error": {
                    "message": INJECTED_ERROR_MESSAGE,
                    "type": "server_error",
                    "param": None,
                    "code": "sim_injected_error",
                }
            }
        )

    def malformed_event(self) -> bytes:
        """The injected malformed event (its data is not JSON)."""
        return MALFORMED_DATA

    def body(self, outputs: list[ChoiceOutput], usage: UsageReport) -> dict[str, Any]:
        """The non-streaming response body."""
        raise NotImplementedError


# -- OpenAI chat and completions ---------------------------------------------------------------


class ChatEncoder(Encoder):
    """``/v1/chat/completions``."""

    api = "chat"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, ctx: WireContext) -> None:
        super().__init__(ctx)
        self.response_id = self.id_prefix + ctx.sim_id
        self._tool_started: set[int] = set()

    def _chunk(self, index: int, payload: dict[str, Any], finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, **payload}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        obj: dict[str, Any] = {
            "id": self.response_id,
            "object": self.chunk_object,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "system_fingerprint": "ai-quota-sim",
            "choices": [choice],
        }
        if self.ctx.include_usage:
            obj["usage"] = None
        return obj

    def opening(self) -> list[bytes]:
        return [
            sse(self._chunk(i, {"delta": {"role": "assistant", "content": ""}}, None))
            for i in range(self.ctx.choices)
        ]

    def _delta_payload(self, choice: int, text: str, kind: str) -> dict[str, Any]:
        if kind == REASONING:
            return {"delta": {"reasoning_content": text}}
        if kind != TOOL:
            return {"delta": {"content": text}}
        if choice not in self._tool_started:
            self._tool_started.add(choice)
            call: dict[str, Any] = {
                "index": 0,
                "id": f"call_{self.ctx.sim_id}_{choice}",
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": text},
            }
        else:
            call = {"index": 0, "function": {"arguments": text}}
        return {"delta": {"tool_calls": [call]}}

    def delta(self, choice: int, text: str, kind: str) -> list[bytes]:
        return [sse(self._chunk(choice, self._delta_payload(choice, text, kind), None))]

    def _finish_payload(self) -> dict[str, Any]:
        return {"delta": {}}

    def usage(self, usage: UsageReport) -> dict[str, Any]:
        """OpenAI usage object for a reported output count (must not be None)."""
        out = usage.output or 0
        obj: dict[str, Any] = {
            "prompt_tokens": self.ctx.prompt_tokens,
            "completion_tokens": out,
            "total_tokens": self.ctx.prompt_tokens + out,
        }
        if self.api == "chat":
            obj["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning}
        return obj

    def closing(self, usage: UsageReport) -> list[bytes]:
        events = [
            sse(self._chunk(i, self._finish_payload(), self.ctx.finish_reason))
            for i in range(self.ctx.choices)
        ]
        if self.ctx.include_usage and usage.output is not None:
            events.append(
                sse(
                    {
                        "id": self.response_id,
                        "object": self.chunk_object,
                        "created": self.ctx.created,
                        "model": self.ctx.model,
                        "system_fingerprint": "ai-quota-sim",
                        "choices": [],
                        "usage": self.usage(usage),
                    }
                )
            )
        events.append(DONE_EVENT)
        return events

    def _choice_body(self, out: ChoiceOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        if self.ctx.tool:
            message["tool_calls"] = [
                {
                    "id": f"call_{self.ctx.sim_id}_{out.index}",
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": out.answer},
                }
            ]
        else:
            message["content"] = out.answer
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        return {"index": out.index, "message": message}

    def body(self, outputs: list[ChoiceOutput], usage: UsageReport) -> dict[str, Any]:
        choices = [
            {**self._choice_body(o), "logprobs": None, "finish_reason": self.ctx.finish_reason}
            for o in outputs
        ]
        obj: dict[str, Any] = {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "system_fingerprint": "ai-quota-sim",
            "choices": choices,
        }
        if usage.output is not None:
            obj["usage"] = self.usage(usage)
        return obj


class CompletionsEncoder(ChatEncoder):
    """``/v1/completions`` (no role chunk, ``text`` instead of ``delta``)."""

    api = "completions"
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def opening(self) -> list[bytes]:
        return []

    def delta(self, choice: int, text: str, kind: str) -> list[bytes]:
        return [sse(self._chunk(choice, {"text": text}, None))]

    def _finish_payload(self) -> dict[str, Any]:
        return {"text": ""}

    def _choice_body(self, out: ChoiceOutput) -> dict[str, Any]:
        return {"index": out.index, "text": out.reasoning + out.answer}


# -- OpenAI Responses API ------------------------------------------------------------------------


class ResponsesEncoder(Encoder):
    """``/v1/responses``: one output item per kind (reasoning, message or function_call)."""

    api = "responses"

    def __init__(self, ctx: WireContext) -> None:
        super().__init__(ctx)
        self.response_id = "resp_" + ctx.sim_id
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # finished output items
        self._kind: str | None = None  # kind of the open item
        self._text = ""  # text of the open item

    @property
    def incomplete(self) -> bool:
        """The budget ran out (Responses reports ``status: incomplete``)."""
        return self.ctx.finish_reason == "length"

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        obj = {"type": kind, "sequence_number": self._seq, **payload}
        self._seq += 1
        return typed_sse(kind, obj)

    def _item_id(self, kind: str) -> str:
        prefix = {REASONING: "rs_", TOOL: "fc_"}.get(kind, "msg_")
        return f"{prefix}{self.ctx.sim_id}"

    def _item(self, kind: str, text: str, status: str) -> dict[str, Any]:
        item_id = self._item_id(kind)
        if kind == REASONING:
            content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
            return {
                "id": item_id,
                "type": "reasoning",
                "summary": [],
                "content": content,
                "encrypted_content": None,
                "status": status,
            }
        if kind == TOOL:
            return {
                "id": item_id,
                "type": "function_call",
                "call_id": f"call_{self.ctx.sim_id}_0",
                "name": TOOL_NAME,
                "arguments": text,
                "status": status,
            }
        content = [self._part(CONTENT, text)] if status != "in_progress" else []
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == REASONING:
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _open(self, kind: str) -> list[bytes]:
        self._kind = kind
        self._text = ""
        index = len(self._items)
        events = [
            self._event(
                "response.output_item.added",
                {"output_index": index, "item": self._item(kind, "", "in_progress")},
            )
        ]
        if kind != TOOL:
            events.append(
                self._event(
                    "response.content_part.added",
                    {
                        "item_id": self._item_id(kind),
                        "output_index": index,
                        "content_index": 0,
                        "part": self._part(kind, ""),
                    },
                )
            )
        return events

    def _close(self) -> list[bytes]:
        kind = self._kind
        if kind is None:
            return []
        index = len(self._items)
        item_id = self._item_id(kind)
        text = self._text
        where = {"item_id": item_id, "output_index": index}
        events: list[bytes] = []
        if kind == TOOL:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    {**where, "name": TOOL_NAME, "arguments": text},
                )
            )
        else:
            done = (
                "response.reasoning_text.done" if kind == REASONING else "response.output_text.done"
            )
            extra: dict[str, Any] = {} if kind == REASONING else {"logprobs": []}
            events.append(self._event(done, {**where, "content_index": 0, "text": text, **extra}))
            events.append(
                self._event(
                    "response.content_part.done",
                    {**where, "content_index": 0, "part": self._part(kind, text)},
                )
            )
        status = "incomplete" if self.incomplete and kind != REASONING else "completed"
        item = self._item(kind, text, status)
        events.append(
            self._event("response.output_item.done", {"output_index": index, "item": item})
        )
        self._items.append(item)
        self._kind = None
        return events

    def response(self, status: str, usage: UsageReport | None) -> dict[str, Any]:
        """The ``response`` object with the items finished so far."""
        usage_obj: dict[str, Any] | None = None
        if usage is not None and usage.output is not None:
            usage_obj = {
                "input_tokens": self.ctx.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage.output,
                "output_tokens_details": {"reasoning_tokens": usage.reasoning},
                "total_tokens": self.ctx.prompt_tokens + usage.output,
            }
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.ctx.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": None,
            "max_output_tokens": self.ctx.max_output_tokens,
            "model": self.ctx.model,
            "output": list(self._items),
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "usage": usage_obj,
        }

    def opening(self) -> list[bytes]:
        skeleton = self.response("in_progress", None)
        return [
            self._event("response.created", {"response": skeleton}),
            self._event("response.in_progress", {"response": skeleton}),
        ]

    def delta(self, choice: int, text: str, kind: str) -> list[bytes]:
        events: list[bytes] = []
        if kind != self._kind:
            events += self._close()
            events += self._open(kind)
        self._text += text
        where = {"item_id": self._item_id(kind), "output_index": len(self._items)}
        if kind == TOOL:
            events.append(
                self._event("response.function_call_arguments.delta", {**where, "delta": text})
            )
        elif kind == REASONING:
            events.append(
                self._event(
                    "response.reasoning_text.delta", {**where, "content_index": 0, "delta": text}
                )
            )
        else:
            events.append(
                self._event(
                    "response.output_text.delta",
                    {**where, "content_index": 0, "delta": text, "logprobs": []},
                )
            )
        return events

    def closing(self, usage: UsageReport) -> list[bytes]:
        events: list[bytes] = []
        if self._kind in (None, REASONING):
            # the answer item exists even when it is empty
            events += self._close()
            events += self._open(TOOL if self.ctx.tool else CONTENT)
        events += self._close()
        status = "incomplete" if self.incomplete else "completed"
        events.append(self._event(f"response.{status}", {"response": self.response(status, usage)}))
        return events

    def error_event(self) -> bytes:
        return self._event(
            "error",
            {"code": "sim_injected_error", "message": INJECTED_ERROR_MESSAGE, "param": None},
        )

    def malformed_event(self) -> bytes:
        return b"event: response.output_text.delta\n" + MALFORMED_DATA

    def body(self, outputs: list[ChoiceOutput], usage: UsageReport) -> dict[str, Any]:
        out = outputs[0]
        self._items = []
        if out.reasoning:
            self._items.append(self._item(REASONING, out.reasoning, "completed"))
        kind = TOOL if self.ctx.tool else CONTENT
        status = "incomplete" if self.incomplete else "completed"
        self._items.append(self._item(kind, out.answer, status))
        return self.response(status, usage)


# -- Anthropic Messages API ----------------------------------------------------------------------

_ANTHROPIC_BLOCK = {REASONING: "thinking", CONTENT: "text", TOOL: "tool_use"}
THINKING_SIGNATURE = "ai-quota-sim"


class MessagesEncoder(Encoder):
    """``/v1/messages`` (Anthropic): content blocks thinking → text or tool_use."""

    api = "messages"

    def __init__(self, ctx: WireContext) -> None:
        super().__init__(ctx)
        self.message_id = "msg_" + ctx.sim_id
        self._index = -1  # index of the open (or last) content block
        self._kind: str | None = None
        self._pinged = False

    @property
    def stop_reason(self) -> str:
        """Anthropic stop reason for the plan."""
        if self.ctx.finish_reason == "length":
            return "max_tokens"
        if self.ctx.tool:
            return "tool_use"
        return "end_turn"

    def _usage(self, output: int) -> dict[str, Any]:
        return {
            "input_tokens": self.ctx.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": output,
        }

    def _block(self, kind: str) -> dict[str, Any]:
        if kind == REASONING:
            return {"type": "thinking", "thinking": "", "signature": ""}
        if kind == TOOL:
            return {
                "type": "tool_use",
                "id": f"toolu_{self.ctx.sim_id}",
                "name": TOOL_NAME,
                "input": {},
            }
        return {"type": "text", "text": ""}

    def opening(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(1),
        }
        return [typed_sse("message_start", {"type": "message_start", "message": message})]

    def _open(self, kind: str) -> list[bytes]:
        self._index += 1
        self._kind = kind
        events = [
            typed_sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": self._index,
                    "content_block": self._block(kind),
                },
            )
        ]
        if not self._pinged:
            self._pinged = True
            events.append(typed_sse("ping", {"type": "ping"}))
        return events

    def _close(self) -> list[bytes]:
        if self._kind is None:
            return []
        events: list[bytes] = []
        if self._kind == REASONING:
            events.append(
                typed_sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self._index,
                        "delta": {"type": "signature_delta", "signature": THINKING_SIGNATURE},
                    },
                )
            )
        events.append(
            typed_sse("content_block_stop", {"type": "content_block_stop", "index": self._index})
        )
        self._kind = None
        return events

    def delta(self, choice: int, text: str, kind: str) -> list[bytes]:
        events: list[bytes] = []
        if kind != self._kind:
            events += self._close()
            events += self._open(kind)
        if kind == REASONING:
            delta = {"type": "thinking_delta", "thinking": text}
        elif kind == TOOL:
            delta = {"type": "input_json_delta", "partial_json": text}
        else:
            delta = {"type": "text_delta", "text": text}
        events.append(
            typed_sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )
        return events

    def closing(self, usage: UsageReport) -> list[bytes]:
        events: list[bytes] = []
        if self._kind in (None, REASONING):
            events += self._close()
            events += self._open(TOOL if self.ctx.tool else CONTENT)
        events += self._close()
        message_delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
        }
        if usage.output is not None:
            message_delta["usage"] = {"output_tokens": usage.output}
        events.append(typed_sse("message_delta", message_delta))
        events.append(typed_sse("message_stop", {"type": "message_stop"}))
        return events

    def error_event(self) -> bytes:
        return typed_sse(
            "error",
            {"type": "error", "error": {"type": "api_error", "message": INJECTED_ERROR_MESSAGE}},
        )

    def malformed_event(self) -> bytes:
        return b"event: content_block_delta\n" + MALFORMED_DATA

    def body(self, outputs: list[ChoiceOutput], usage: UsageReport) -> dict[str, Any]:
        out = outputs[0]
        content: list[dict[str, Any]] = []
        if out.reasoning:
            content.append(
                {"type": "thinking", "thinking": out.reasoning, "signature": THINKING_SIGNATURE}
            )
        if self.ctx.tool:
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{self.ctx.sim_id}",
                    "name": TOOL_NAME,
                    "input": orjson.loads(out.answer),
                }
            )
        else:
            content.append({"type": "text", "text": out.answer})
        obj: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
        }
        if usage.output is not None:
            obj["usage"] = self._usage(usage.output)
        return obj


ENCODERS: dict[str, type[Encoder]] = {
    "chat": ChatEncoder,
    "completions": CompletionsEncoder,
    "responses": ResponsesEncoder,
    "messages": MessagesEncoder,
}


# -- errors --------------------------------------------------------------------------------------

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
