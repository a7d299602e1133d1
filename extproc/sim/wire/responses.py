"""The simulator's OpenAI Responses API encoder: typed events with ``event:`` lines and a
``sequence_number``, one output item per kind of output (reasoning, message, function_call).
"""

from __future__ import annotations

from typing import Any

from extproc.sim.wire.base import (
    CONTENT,
    INJECTED_ERROR_MESSAGE,
    MALFORMED_DATA,
    REASONING,
    TOOL,
    TOOL_NAME,
    ChoiceOutput,
    Encoder,
    UsageReport,
    WireContext,
    typed_sse,
)


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
