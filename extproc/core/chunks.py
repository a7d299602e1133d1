"""What one OpenAI-style stream event says: output text pieces, finish reasons, usage, errors.

:func:`parse_event_data` reads the ``data`` of one SSE event of a ``/v1/chat/completions`` or
``/v1/completions`` stream and returns a :class:`StreamChunk`; :class:`OutputTokenCounter`
adds up the output tokens of those chunks as they pass, per choice.

Output text is taken from chat ``delta.content``, ``delta.reasoning_content``,
``delta.reasoning``, ``delta.refusal``, ``delta.tool_calls[*].function.arguments`` (and the
legacy ``delta.function_call.arguments``), and from completions ``choices[*].text``.  Tool and
function *names* are not counted: they are short, come from the request's tool list, and
OpenAI bills the call's arguments, not its name.  A ``content`` given as a list of parts
contributes the ``text`` of each part.

Structure is checked, leaves are read leniently: data that is not JSON, not an object, a
``choices`` that is neither absent, null nor a list, or a choice that is not an object raises
:class:`MalformedChunk`; a missing or non-integer ``index`` means choice 0, and null or
non-string text fields, a null ``delta`` and a non-list ``tool_calls`` are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from extproc.core.values import is_int

__all__ = [
    "DONE",
    "MalformedChunk",
    "OutputTokenCounter",
    "StreamChunk",
    "Usage",
    "detail",
    "parse_event_data",
]

DONE: Final = "[DONE]"
_DELTA_TEXT_KEYS: Final = ("content", "reasoning_content", "reasoning", "refusal")


class MalformedChunk(ValueError):  # name fixed by the core API
    """The event data is not a JSON object of the expected shape."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage the upstream reported, normalised across APIs (``prompt_tokens`` includes cached
    input, ``completion_tokens`` includes reasoning)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # part of prompt_tokens read from a prompt cache; part of completion_tokens spent reasoning
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(slots=True)
class StreamChunk:
    """The parts of one stream event that matter for metering."""

    done: bool = False
    texts: list[tuple[int, str]] = field(default_factory=list)
    usage: Usage | None = None
    is_usage_only: bool = False
    error: dict[str, Any] | None = None
    finish_reasons: list[tuple[int, str]] = field(default_factory=list)


def _usage(value: object) -> Usage | None:
    """``Usage`` when prompt and completion counts are ints; a missing total is their sum."""
    if not isinstance(value, dict):
        return None
    prompt = value.get("prompt_tokens")
    completion = value.get("completion_tokens")
    if not (is_int(prompt) and is_int(completion)):
        return None
    assert isinstance(prompt, int)
    assert isinstance(completion, int)
    total = value.get("total_tokens")
    if not (isinstance(total, int) and is_int(total)):
        total = prompt + completion
    return Usage(
        prompt,
        completion,
        total,
        cached_input_tokens=detail(value, "prompt_tokens_details", "cached_tokens"),
        reasoning_tokens=detail(value, "completion_tokens_details", "reasoning_tokens"),
    )


def detail(usage: dict[str, Any], group: str, name: str) -> int:
    """``usage[group][name]`` when it is a non-negative int, else 0."""
    g = usage.get(group)
    v = g.get(name) if isinstance(g, dict) else None
    return v if isinstance(v, int) and is_int(v) and v >= 0 else 0


def _add_text(texts: list[tuple[int, str]], index: int, value: object) -> None:
    if isinstance(value, str):
        if value:
            texts.append((index, value))
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str) and text:
                    texts.append((index, text))


def _add_delta(texts: list[tuple[int, str]], index: int, delta: dict[str, Any]) -> None:
    for key in _DELTA_TEXT_KEYS:
        value = delta.get(key)
        if value is not None:
            _add_text(texts, index, value)
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                function = call.get("function")
                if isinstance(function, dict):
                    arguments = function.get("arguments")
                    if isinstance(arguments, str) and arguments:
                        texts.append((index, arguments))
    legacy = delta.get("function_call")
    if isinstance(legacy, dict):
        arguments = legacy.get("arguments")
        if isinstance(arguments, str) and arguments:
            texts.append((index, arguments))


def parse_event_data(data: str) -> StreamChunk:
    """Parse the ``data`` of one stream event; raise :class:`MalformedChunk` if it is unusable."""
    if data == DONE or data.strip() == DONE:
        return StreamChunk(done=True)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MalformedChunk(f"event data is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedChunk(f"event data is a JSON {type(obj).__name__}, not an object")
    chunk = StreamChunk()
    error = obj.get("error")
    if isinstance(error, dict):
        chunk.error = error
    elif isinstance(error, str):
        chunk.error = {"message": error}
    choices = obj.get("choices")
    if choices is None:
        choices = []
    elif not isinstance(choices, list):
        raise MalformedChunk(f"choices is a JSON {type(choices).__name__}, not a list")
    texts = chunk.texts
    for choice in choices:
        if not isinstance(choice, dict):
            raise MalformedChunk(f"a choice is a JSON {type(choice).__name__}, not an object")
        raw_index = choice.get("index")
        index = raw_index if isinstance(raw_index, int) and is_int(raw_index) else 0
        delta = choice.get("delta")
        if isinstance(delta, dict):
            _add_delta(texts, index, delta)
        text = choice.get("text")
        if text is not None:
            _add_text(texts, index, text)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            chunk.finish_reasons.append((index, reason))
    usage = obj.get("usage")
    if usage is not None:
        chunk.usage = _usage(usage)
        chunk.is_usage_only = chunk.usage is not None and not choices
    return chunk


class OutputTokenCounter:
    """Running output-token count of one stream, per choice and in total.

    Policy: each text piece is counted on its own as it arrives and the counts are summed
    (no re-tokenisation of the accumulated text); see ``docs/streaming-counting.md`` for how
    close that stays to counting the whole text once.
    """

    __slots__ = ("_count", "per_choice", "total")

    def __init__(self, count: Callable[[str], int]) -> None:
        """Count with ``count`` (a tokenizer's ``str -> number of tokens`` function)."""
        self._count = count
        self.total = 0
        self.per_choice: dict[int, int] = {}

    def add(self, chunk: StreamChunk) -> int:
        """Count the text pieces of ``chunk``; return the tokens it added."""
        added = 0
        per_choice = self.per_choice
        for index, text in chunk.texts:
            tokens = self._count(text)
            if tokens:
                per_choice[index] = per_choice.get(index, 0) + tokens
                added += tokens
        self.total += added
        return added
