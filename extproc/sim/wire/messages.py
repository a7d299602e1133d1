"""The simulator's Anthropic Messages API encoder (``event:`` lines, ``message_start`` …
``message_stop``; content blocks thinking → text or tool_use), and the JSON wrapper that makes
tool arguments a ``tool_use`` input with exact token counts.
"""

from __future__ import annotations

from typing import Any

import orjson

from extproc.sim.text import count_tokens
from extproc.sim.wire.base import (
    CONTENT,
    INJECTED_ERROR_MESSAGE,
    MALFORMED_DATA,
    REASONING,
    TOOL,
    TOOL_NAME,
    ChoiceOutput,
    Encoder,
    Unit,
    UsageReport,
    WireContext,
    typed_sse,
)

#: Anthropic tool_use input is JSON: the token-exact text is wrapped as {"text": "<text>"}
TOOL_JSON_PREFIX = '{"text": "'
TOOL_JSON_SUFFIX = '"}'


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
