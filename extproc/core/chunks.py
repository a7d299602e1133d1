"""What one stream event says, whatever the API: output text pieces, finish reasons, usage,
errors (:class:`StreamChunk`), the usage figures normalised across APIs (:class:`Usage`), and
:class:`OutputTokenCounter`, which adds up a stream's output tokens per choice.

Each API's reader (``extproc.core.apis.<api>``) turns its events into these; the OpenAI one
is :mod:`extproc.core.apis.openai.stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from extproc.core.values import is_int

__all__ = [
    "DONE",
    "MalformedChunk",
    "OutputTokenCounter",
    "StreamChunk",
    "Usage",
    "detail",
]

DONE: Final = "[DONE]"


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


def detail(usage: dict[str, Any], group: str, name: str) -> int:
    """``usage[group][name]`` when it is a non-negative int, else 0."""
    g = usage.get(group)
    v = g.get(name) if isinstance(g, dict) else None
    return v if isinstance(v, int) and is_int(v) and v >= 0 else 0


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
