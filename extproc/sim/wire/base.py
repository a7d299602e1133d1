"""What every wire encoder of the simulator shares (pure: bytes and dicts, no I/O): the output
units and request context an encoder works from, the ``data:`` / ``event:`` framing, the
injected error and malformed events, and the :class:`Encoder` interface itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

TOOL_NAME = "sim_tool"
MALFORMED_DATA = b"data: {not json\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
INJECTED_ERROR_MESSAGE = "injected in-stream error (x-sim-error-event-after)"

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
