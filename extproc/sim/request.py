"""Parsing of OpenAI request bodies and ``x-sim-*`` control headers (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.sim.config import SimConfig
from extproc.sim.text import count_tokens

MAX_N = 128
#: upper bound on prompts x n for a batched completions request
MAX_CHOICES = 1024
#: default embedding size (``dimensions`` overrides it) and limits
EMBEDDING_DIMS = 8
MAX_EMBEDDING_DIMS = 4096
MAX_EMBEDDING_INPUTS = 2048

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
    #: completions only: number of prompts in a batch (``prompt`` as a list of prompts)
    prompts: int = 1
    #: completions only: the request's ``best_of`` (validated, otherwise ignored)
    best_of: int | None = None

    @property
    def choices(self) -> int:
        """Choices generated: ``n`` per prompt (index ``prompt_i * n + j``, as vLLM does)."""
        return self.prompts * self.n


@dataclass(frozen=True, slots=True)
class UsageLie:
    """``x-sim-usage``: what the final usage reports instead of the real output-token count."""

    mode: str  # "fixed" | "scale" | "absent"
    value: float = 0.0

    def reported(self, real: int) -> int | None:
        """The output-token count to report for ``real`` generated tokens (None = omit usage)."""
        if self.mode == "absent":
            return None
        if self.mode == "scale":
            return max(0, round(real * self.value))
        return int(self.value)


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """The parts of an embeddings body the simulator acts on."""

    model: str
    input_tokens: tuple[int, ...]
    input_keys: tuple[str, ...]
    dimensions: int
    encoding_format: str

    @property
    def prompt_tokens(self) -> int:
        """Input tokens over all inputs."""
        return sum(self.input_tokens)


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
    chunk_tokens: int | None = None
    burst_tokens: int | None = None
    gzip: bool = False
    honour_accept_encoding: bool = False
    content_type: str | None = None
    usage: UsageLie | None = None
    ignore_max_tokens: bool = False
    content_length: bool = False

    @property
    def per_chunk(self) -> int | None:
        """Tokens per streamed event asked by the headers (burst > chunk > tokens-per-chunk)."""
        return self.burst_tokens or self.chunk_tokens or self.tokens_per_chunk


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
    model = _model(body, config)
    prompts = 1
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty array", param="messages")
        prompt_tokens = chat_prompt_tokens(messages)
    else:
        if "prompt" not in body:
            raise RequestError(400, "'prompt' is required", param="prompt")
        prompt = body.get("prompt")
        prompt_tokens = completion_prompt_tokens(prompt)
        prompts = prompt_count(prompt)
    stream = _stream_flag(body)
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
    best_of = None if chat else _positive_int(body, "best_of", 1)
    if best_of is not None and best_of < n:
        raise RequestError(400, "'best_of' must be >= 'n'", param="best_of", code="invalid_value")
    if n * prompts > MAX_CHOICES:
        raise RequestError(
            400, f"at most {MAX_CHOICES} choices (prompts x n) per request", param="prompt"
        )
    return GenerationRequest(
        model=model,
        stream=stream,
        include_usage=include_usage,
        n=n,
        requested_max_tokens=max(limits) if limits else None,
        prompt_tokens=prompt_tokens,
        prompts=prompts,
        best_of=best_of,
    )


def prompt_count(prompt: Any) -> int:
    """Number of prompts in a completions ``prompt``: a list of strings / token arrays is a batch."""
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return 1
        return len(prompt)
    return 1


def _model(body: Any, config: SimConfig) -> str:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "you must provide a model parameter", param="model")
    if model not in config.models:
        raise RequestError(
            404, f"The model '{model}' does not exist", param="model", code="model_not_found"
        )
    return model


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", param="stream")
    return stream


def responses_prompt_tokens(instructions: Any, items: Any) -> int:
    """Input tokens of a Responses request, approximated like chat messages.

    ``instructions`` counts as a system message; ``input`` is a string (one user message) or a
    list of items: messages (string or ``input_text`` parts), ``function_call_output`` items
    (their ``output``) and ``function_call`` items (their ``arguments``).
    """
    messages: list[Any] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call_output":
                messages.append({"role": "tool", "content": item.get("output")})
            elif item.get("type") == "function_call":
                messages.append({"role": "assistant", "content": item.get("arguments")})
            else:
                messages.append(item)
    return chat_prompt_tokens(messages)


def parse_responses(body: Any, *, config: SimConfig) -> GenerationRequest:
    """Validate a ``POST /v1/responses`` body (OpenAI Responses API)."""
    model = _model(body, config)
    items = body.get("input")
    if not isinstance(items, str | list) or (isinstance(items, list) and not items):
        raise RequestError(400, "'input' must be a string or a non-empty array", param="input")
    return GenerationRequest(
        model=model,
        stream=_stream_flag(body),
        include_usage=True,
        n=1,
        requested_max_tokens=_positive_int(body, "max_output_tokens", 1),
        prompt_tokens=responses_prompt_tokens(body.get("instructions"), items),
    )


def messages_prompt_tokens(system: Any, messages: list[Any]) -> int:
    """Input tokens of an Anthropic Messages request, approximated like chat messages.

    ``system`` (a string or text blocks) counts as one message; content blocks of type ``text``
    count, ``tool_result`` blocks count their text content, other blocks (images, tool_use) not.
    """
    converted: list[Any] = []
    if system is not None:
        converted.append({"role": "system", "content": system})
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            parts: list[Any] = []
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    inner = block.get("content")
                    parts.append({"type": "text", "text": _content_text(inner)})
                else:
                    parts.append(block)
            content = parts
        converted.append({"role": message.get("role"), "content": content})
    return chat_prompt_tokens(converted)


def parse_messages(body: Any, *, config: SimConfig) -> GenerationRequest:
    """Validate a ``POST /v1/messages`` body (Anthropic Messages API as vLLM/SGLang serve it)."""
    model = _model(body, config)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: Field required", param="messages")
    if body.get("max_tokens") is None:
        raise RequestError(400, "max_tokens: Field required", param="max_tokens")
    return GenerationRequest(
        model=model,
        stream=_stream_flag(body),
        include_usage=True,
        n=1,
        requested_max_tokens=_positive_int(body, "max_tokens", 1),
        prompt_tokens=messages_prompt_tokens(body.get("system"), messages),
    )


def _embedding_inputs(raw: Any) -> list[Any]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
            return [raw]
        if all(
            isinstance(v, str)
            or (
                isinstance(v, list)
                and v
                and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            )
            for v in raw
        ):
            return list(raw)
    raise RequestError(
        400,
        "'input' must be a string, an array of strings, an array of token ids or an array of"
        " token-id arrays",
        param="input",
    )


def parse_embeddings(body: Any, *, config: SimConfig) -> EmbeddingsRequest:
    """Validate a ``POST /v1/embeddings`` body."""
    model = _model(body, config)
    if "input" not in body:
        raise RequestError(400, "'input' is required", param="input")
    inputs = _embedding_inputs(body.get("input"))
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise RequestError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs", param="input")
    dims = _positive_int(body, "dimensions", 1) or EMBEDDING_DIMS
    if dims > MAX_EMBEDDING_DIMS:
        raise RequestError(400, f"'dimensions' must be <= {MAX_EMBEDDING_DIMS}", param="dimensions")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError(
            400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    tokens = tuple(count_tokens(v) if isinstance(v, str) else len(v) for v in inputs)
    keys = tuple(v if isinstance(v, str) else ",".join(str(t) for t in v) for v in inputs)
    return EmbeddingsRequest(
        model=model, input_tokens=tokens, input_keys=keys, dimensions=dims, encoding_format=fmt
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
    content_type = headers.get("x-sim-content-type")
    if content_type is not None:
        content_type = content_type.strip()
        if not content_type or any(c in content_type for c in "\r\n"):
            raise RequestError(400, "header x-sim-content-type must be a value or 'none'")
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
        tool_call=_header_flag(headers, "x-sim-tool-call"),
        chunk_tokens=_header_int(headers, "x-sim-chunk-tokens", minimum=1),
        burst_tokens=_header_int(headers, "x-sim-burst-tokens", minimum=1),
        gzip=_header_flag(headers, "x-sim-gzip"),
        honour_accept_encoding=_header_flag(headers, "x-sim-honour-accept-encoding"),
        content_type=content_type,
        usage=parse_usage_lie(headers.get("x-sim-usage")),
        ignore_max_tokens=_header_flag(headers, "x-sim-ignore-max-tokens"),
        content_length=_header_flag(headers, "x-sim-content-length"),
    )


_TRUE = ("1", "true", "yes", "on")


def _header_flag(headers: Mapping[str, str], name: str) -> bool:
    return headers.get(name, "").strip().lower() in _TRUE


def parse_usage_lie(raw: str | None) -> UsageLie | None:
    """``x-sim-usage``: ``<int>`` (report that count), ``scale:<float>`` or ``absent``."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value == "absent":
        return UsageLie("absent")
    try:
        if value.startswith("scale:"):
            factor = float(value.removeprefix("scale:"))
            if not factor >= 0 or factor == float("inf"):
                raise ValueError(value)
            return UsageLie("scale", factor)
        count = int(value)
    except ValueError:
        raise RequestError(
            400, f"header x-sim-usage must be <int>, scale:<float> or absent, got {raw!r}"
        ) from None
    if count < 0:
        raise RequestError(400, "header x-sim-usage must be >= 0")
    return UsageLie("fixed", float(count))


@dataclass(frozen=True, slots=True)
class Plan:
    """How long each choice's answer is and why it ends."""

    limit: int
    tokens_per_choice: int
    finish_reason: str


def plan_answer(req: GenerationRequest, controls: SimControls, config: SimConfig) -> Plan:
    """Answer length per choice: the max-tokens limit, or ``x-sim-tokens`` when shorter.

    Without a limit in the request the answer has ``default_tokens`` tokens, or, with
    ``x-sim-ignore-max-tokens``, the rest of the context (``context_tokens - prompt_tokens``,
    not capped by ``max_tokens_cap``), like a real vLLM.

    ``finish_reason`` is "length" when the answer is cut by an explicit max_tokens limit,
    "tool_calls" for tool-call answers, else "stop".
    """
    context_run = False
    if req.requested_max_tokens is not None:
        limit = min(req.requested_max_tokens, config.max_tokens_cap)
    elif controls.ignore_max_tokens:
        # a real vLLM without max_tokens generates up to the end of the context window
        limit = max(0, config.context_tokens - req.prompt_tokens)
        context_run = True
    else:
        limit = config.default_tokens
    tokens = limit if controls.tokens is None else min(controls.tokens, limit)
    if controls.tool_call:
        reason = "tool_calls"
    elif (req.requested_max_tokens is not None or context_run) and tokens >= limit:
        reason = "length"
    else:
        reason = "stop"
    return Plan(limit=limit, tokens_per_choice=tokens, finish_reason=reason)
