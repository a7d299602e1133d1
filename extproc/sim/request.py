"""Parsing of the simulator's request bodies (pure, no I/O): chat, completions, Responses and
Messages bodies into a :class:`GenerationRequest`, embeddings bodies into an
:class:`EmbeddingsRequest`, or a :class:`RequestError` with the status and OpenAI-style error the
API would answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.sim.config import SimConfig
from extproc.sim.prompt_tokens import (
    chat_prompt_tokens,
    completion_prompt_tokens,
    messages_prompt_tokens,
    responses_prompt_tokens,
)
from extproc.sim.text import count_tokens

MAX_N = 128
#: upper bound on prompts x n for a batched completions request
MAX_CHOICES = 1024
#: default embedding size (``dimensions`` overrides it) and limits
EMBEDDING_DIMS = 8
MAX_EMBEDDING_DIMS = 4096
MAX_EMBEDDING_INPUTS = 2048


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
    #: chat and completions: vLLM's per-request ``stream_interval`` (tokens per streamed chunk
    #: after the first, which holds one token)
    stream_interval: int | None = None

    @property
    def choices(self) -> int:
        """Choices generated: ``n`` per prompt (index ``prompt_i * n + j``, as vLLM does)."""
        return self.prompts * self.n


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
        stream_interval=_positive_int(body, "stream_interval", 1),
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
