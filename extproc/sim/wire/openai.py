"""The simulator's OpenAI chat completions (``chat.completion`` / ``chat.completion.chunk``,
``data:`` lines ending with ``[DONE]``) and legacy completions (``text_completion``) encoders.
"""

from __future__ import annotations

from typing import Any

from extproc.sim.wire.base import (
    DONE_EVENT,
    REASONING,
    TOOL,
    TOOL_NAME,
    ChoiceOutput,
    Encoder,
    UsageReport,
    WireContext,
    sse,
)


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
