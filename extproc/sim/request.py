"""Parsing of OpenAI request bodies and ``x-sim-*`` control headers (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.sim.config import SimConfig
from extproc.sim.text import count_tokens

MAX_N = 128

#: per-message and per-conversation overhead used for the chat prompt-token approximation
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REPLY = 3


class RequestError(Exception):
    """A request the simulator rejects with an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """The parts of a chat/completions body the simulator acts on."""

    model: str
    stream: bool
    include_usage: bool
    n: int
    requested_max_tokens: int | None
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class SimControls:
    """Per-request overrides read from ``x-sim-*`` headers (None = not given)."""

    tokens: int | None = None
    seed: int | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tokens_per_chunk: int | None = None
    status: int | None = None
    disconnect_after: int | None = None
    slow_start_ms: float | None = None
    malformed_after: int | None = None
    error_event_after: int | None = None
    reasoning: int = 0
    tool_call: bool = False


def _positive_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{key}' must be an integer", param=key, code="invalid_type")
    if value < minimum:
        raise RequestError(
            400, f"'{key}' must be >= {minimum}, got {value}", param=key, code="invalid_value"
        )
    return value


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text")
        ]
        return "".join(parts)
    return ""


def chat_prompt_tokens(messages: list[Any]) -> int:
    """Approximate prompt tokens: cl100k tokens of text contents (+ names), +3/message, +3."""
    total = TOKENS_PER_REPLY
    for message in messages:
        total += TOKENS_PER_MESSAGE
        if isinstance(message, dict):
            total += count_tokens(_content_text(message.get("content")))
            name = message.get("name")
            if isinstance(name, str):
                total += count_tokens(name)
    return total


def completion_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a completions prompt: a string, list of strings or token-id arrays."""
    if isinstance(prompt, str):
        return count_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return len(prompt)
        return sum(completion_prompt_tokens(p) for p in prompt)
    return 0


def parse_generation(body: Any, *, chat: bool, config: SimConfig) -> GenerationRequest:
    """Validate a decoded JSON body; raises ``RequestError`` (400/404) like the OpenAI API."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "you must provide a model parameter", param="model")
    if model not in config.models:
        raise RequestError(
            404, f"The model '{model}' does not exist", param="model", code="model_not_found"
        )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty array", param="messages")
        prompt_tokens = chat_prompt_tokens(messages)
    else:
        if "prompt" not in body:
            raise RequestError(400, "'prompt' is required", param="prompt")
        prompt_tokens = completion_prompt_tokens(body.get("prompt"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", param="stream")
    include_usage = False
    options = body.get("stream_options")
    if isinstance(options, dict):
        include_usage = options.get("include_usage") is True
    n = _positive_int(body, "n", 1) or 1
    if n > MAX_N:
        raise RequestError(400, f"'n' must be <= {MAX_N}", param="n", code="invalid_value")
    limits = [
        v
        for v in (
            _positive_int(body, "max_tokens", 1),
            _positive_int(body, "max_completion_tokens", 1),
        )
        if v is not None
    ]
    return GenerationRequest(
        model=model,
        stream=stream,
        include_usage=include_usage,
        n=n,
        requested_max_tokens=max(limits) if limits else None,
        prompt_tokens=prompt_tokens,
    )


def _header_int(headers: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise RequestError(400, f"header {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise RequestError(400, f"header {name} must be >= {minimum}, got {value}")
    return value


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise RequestError(400, f"header {name} must be a number, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise RequestError(400, f"header {name} must be a finite number >= 0")
    return value


def parse_controls(headers: Mapping[str, str]) -> SimControls:
    """Read the ``x-sim-*`` headers (``headers`` keys must be lower-case)."""
    status = _header_int(headers, "x-sim-status")
    if status is not None and not 400 <= status <= 599:
        raise RequestError(400, "header x-sim-status must be an HTTP error status (400-599)")
    tool = headers.get("x-sim-tool-call", "").strip().lower()
    return SimControls(
        tokens=_header_int(headers, "x-sim-tokens"),
        seed=_header_int(headers, "x-sim-seed", minimum=-(2**63)),
        ttft_ms=_header_ms(headers, "x-sim-ttft-ms"),
        itl_ms=_header_ms(headers, "x-sim-itl-ms"),
        tokens_per_chunk=_header_int(headers, "x-sim-tokens-per-chunk", minimum=1),
        status=status,
        disconnect_after=_header_int(headers, "x-sim-disconnect-after"),
        slow_start_ms=_header_ms(headers, "x-sim-slow-start-ms"),
        malformed_after=_header_int(headers, "x-sim-malformed-after"),
        error_event_after=_header_int(headers, "x-sim-error-event-after"),
        reasoning=_header_int(headers, "x-sim-reasoning") or 0,
        tool_call=tool in ("1", "true", "yes", "on"),
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """How long each choice's answer is and why it ends."""

    limit: int
    tokens_per_choice: int
    finish_reason: str


def plan_answer(req: GenerationRequest, controls: SimControls, config: SimConfig) -> Plan:
    """Answer length per choice: the max-tokens limit, or ``x-sim-tokens`` when shorter.

    ``finish_reason`` is "length" when the answer is cut by an explicit max_tokens limit,
    "tool_calls" for tool-call answers, else "stop".
    """
    if req.requested_max_tokens is not None:
        limit = min(req.requested_max_tokens, config.max_tokens_cap)
    else:
        limit = config.default_tokens
    tokens = limit if controls.tokens is None else min(controls.tokens, limit)
    if controls.tool_call:
        reason = "tool_calls"
    elif req.requested_max_tokens is not None and tokens >= limit:
        reason = "length"
    else:
        reason = "stop"
    return Plan(limit=limit, tokens_per_choice=tokens, finish_reason=reason)
