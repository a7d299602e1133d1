"""What every API format provides: request parsing, input counting, body rewriting, the stream
event reader, the non-streaming usage reader and error rendering in the API's own shape.

The processor never looks at a body itself: it asks the request's :class:`ApiFormat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from extproc.core.chunks import StreamChunk, Usage
from extproc.core.tokens import TokenCounter, TokenizerSpec
from extproc.errors import GatewayError

ApiName = Literal["chat", "completions", "responses", "messages", "embeddings"]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Validation bounds from the rules file (``requests:``)."""

    max_tokens_ceiling: int
    max_n: int


@dataclass(slots=True)
class ParsedRequest:
    """What admission needs to know about a request body, whatever the API.

    ``sequences`` is how many outputs the upstream may generate for it: ``n`` times the number of
    prompts (times ``best_of`` where that is larger than ``n``); ``declared_max_output`` is the
    client's budget for one of them, None when the client gave none.
    """

    api: ApiName
    model: str
    stream: bool
    sequences: int
    declared_max_output: int | None
    body: dict[str, Any]
    # chat/completions: the client asked for the usage chunk itself (others always get usage)
    client_include_usage: bool = True
    # the fields holding the output budget in this API (written back when clamping)
    budget_fields: tuple[str, ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)


class StreamReader(Protocol):
    """Reads one response stream's events in order (may keep state between events)."""

    def read(self, event: str | None, data: str) -> StreamChunk:
        """The :class:`StreamChunk` for one SSE event (``event`` is its
        ``event:`` field, ``data`` its data); raises ``MalformedChunk`` on a broken shape."""
        ...


class Reassembler(Protocol):
    """Rebuilds a non-streaming response's JSON from the stream the upstream sent instead
    (the exact path): fed the SSE bytes that passed the meter, in order."""

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream."""
        ...

    def body(self) -> bytes:
        """The API's JSON response body for what was fed (at the stream's end)."""
        ...


class ApiFormat(Protocol):
    """One client-facing API."""

    name: ApiName
    # the response may be an SSE stream at all (embeddings: never)
    can_stream: bool

    def parse(self, raw: bytes, limits: RequestLimits) -> ParsedRequest:
        """Validate the body; raise ``BadRequest`` naming the field that is wrong."""
        ...

    def count_input(self, req: ParsedRequest, counter: TokenCounter, spec: TokenizerSpec) -> int:
        """Input tokens with the model's tokenizer (raise ``PromptShapeError`` / ``PromptTooLarge``)."""
        ...

    def rewrite(
        self,
        req: ParsedRequest,
        *,
        budget: int | None,
        force_usage: bool,
        model: str | None,
        continuous_usage: bool = False,
        upstream_stream: bool = False,
        stream_interval: int | None = None,
    ) -> bytes | None:
        """The body to forward, or None when unchanged.

        ``budget``: the per-sequence output budget admission reserved; the forwarded body must
        carry it (added when absent, lowered when larger). ``force_usage``: ask a streaming
        upstream for usage (chat/completions). ``model``: the canonical model name.
        ``continuous_usage``: ask the engine for running usage in every chunk (chat/completions
        on vLLM or SGLang; other APIs ignore it). ``upstream_stream``: send a non-stream
        upstream as a stream with usage (the exact path). ``stream_interval``: with it, ask
        the engine for that many tokens per chunk (vLLM's ``stream_interval``; chat and
        completions, other APIs ignore it).
        """
        ...

    def stream_reader(self) -> StreamReader:
        """A fresh reader for one response stream."""
        ...

    def reassembles(self, req: ParsedRequest) -> bool:
        """Whether this non-streaming request can be sent upstream as a stream and its JSON
        rebuilt for the client (the exact path; embeddings never)."""
        ...

    def reassembler(self) -> Reassembler:
        """A fresh reassembler for one response (only asked when :meth:`reassembles`)."""
        ...

    def json_usage(self, body: bytes) -> Usage | None:
        """The usage of a non-streaming response body, None when absent or unreadable."""
        ...

    def error_body(self, err: GatewayError) -> bytes:
        """The JSON body of an immediate error response in this API's shape."""
        ...

    def error_headers(self, err: GatewayError) -> list[tuple[str, str]]:
        """Headers of that response (content type, retry-after, rate-limit headers)."""
        ...

    def cut_events(self, err: GatewayError) -> bytes:
        """The SSE event that ends a stream cut for ``err`` (the SDKs raise on it); nothing follows
        it, and the server aborts the HTTP response after it."""
        ...
