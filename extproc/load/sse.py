"""What a load client makes of an OpenAI-style stream (sans-IO).

Bytes become events with the gateway's own decoder (:class:`extproc.core.sse.SSEDecoder`);
only an event's ``data`` matters here. Each payload is either ``[DONE]`` or a JSON chunk that
carries content, usage, or an in-band error (how the gateway cuts a stream).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.core.sse import SSEEvent
from extproc.load.records import Outcome

DONE = "[DONE]"
#: Largest stream event a load client accepts (the gateway's own limit is lower).
MAX_EVENT_BYTES = 16 << 20


def data_payloads(events: Iterable[SSEEvent]) -> list[str]:
    """The ``data`` of each event that has one (comment-only and data-less events dropped)."""
    return [ev.data for ev in events if ev.data is not None]


@dataclass(frozen=True)
class ErrorInfo:
    """An OpenAI-style error object (from an SSE error event or a JSON error body)."""

    message: str | None
    type: str | None
    code: str | None

    @property
    def is_quota_cut(self) -> bool:
        """True when the error means the quota ran out (the gateway's mid-stream cut)."""
        return ("limit_exceeded" in (self.code or "")) or self.type in ("tokens", "requests")


def parse_error(obj: Any) -> ErrorInfo | None:
    """Extract ``{"error": {...}}`` from a decoded JSON value, if present."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return ErrorInfo(
            message=_str_or_none(err.get("message")),
            type=_str_or_none(err.get("type")),
            code=_str_or_none(err.get("code")),
        )
    if isinstance(err, str):
        return ErrorInfo(message=err, type=None, code=None)
    return None


def _str_or_none(v: Any) -> str | None:
    return None if v is None else str(v)


def extract_content(obj: Any) -> str:
    """Text of a chunk or response: chat ``delta.content`` / ``message.content`` or ``text``."""
    if not isinstance(obj, dict):
        return ""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return ""
    parts: list[str] = []
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        for key in ("delta", "message"):
            sub = ch.get(key)
            if isinstance(sub, dict) and isinstance(sub.get("content"), str):
                parts.append(sub["content"])
        if isinstance(ch.get("text"), str):
            parts.append(ch["text"])
    return "".join(parts)


def extract_usage(obj: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` from a ``usage`` object, ``None`` when absent."""
    if not isinstance(obj, dict):
        return None, None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None, None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        p if isinstance(p, int) and not isinstance(p, bool) else None,
        c if isinstance(c, int) and not isinstance(c, bool) else None,
    )


@dataclass
class StreamState:
    """Accumulates the meaning of a stream's events and classifies how it ended."""

    done: bool = False
    error: ErrorInfo | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    events: int = 0
    bad_events: int = 0
    events_after_done: int = 0
    contents: list[str] = field(default_factory=list)

    def on_event(self, payload: str) -> str:
        """Consume one event payload; return its content text ("" if none)."""
        self.events += 1
        if self.done:
            self.events_after_done += 1
        if payload.strip() == DONE:
            self.done = True
            return ""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.bad_events += 1
            return ""
        err = parse_error(obj)
        if err is not None:
            if self.error is None:
                self.error = err
            return ""
        p, c = extract_usage(obj)
        if p is not None:
            self.prompt_tokens = p
        if c is not None:
            self.completion_tokens = c
        return extract_content(obj)

    def outcome(self) -> tuple[Outcome, str | None]:
        """Classify the finished stream: ``cut``, ``ok`` or ``failed`` with a reason."""
        if self.error is not None:
            if self.error.is_quota_cut:
                return "cut", None
            return "failed", f"stream_error:{self.error.code or self.error.type or 'unknown'}"
        if self.done:
            return "ok", None
        return "failed", "stream_ended_without_done"


def classify_stream(payloads: list[str]) -> tuple[Outcome, str | None]:
    """Classify a complete list of event payloads (convenience for tests and tools)."""
    st = StreamState()
    for p in payloads:
        st.on_event(p)
    return st.outcome()
