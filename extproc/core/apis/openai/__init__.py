"""OpenAI's chat completions (``/v1/chat/completions``) and completions (``/v1/completions``).

Both stream ``data:`` events ending with ``data: [DONE]``; usage comes in a final chunk when
``stream_options.include_usage`` is set (the gateway forces it and strips that chunk again
when the client did not ask for it).
"""

from __future__ import annotations

import orjson

from extproc.core.apis.base import ApiName, ParsedRequest, RequestLimits
from extproc.core.apis.errors import error_body, error_headers, openai_cut_event
from extproc.core.apis.openai.counting import count_chat_request, count_completion_prompt
from extproc.core.apis.openai.reassemble import chat_reassembler, completion_reassembler
from extproc.core.apis.openai.request import parse_request, rewrite_body
from extproc.core.apis.openai.stream import parse_event_data
from extproc.core.apis.reassembly import BufferedStream
from extproc.core.chat_template import count_with_template
from extproc.core.chunks import MalformedChunk, StreamChunk, Usage
from extproc.core.tokens import TokenCounter, TokenizerSpec
from extproc.errors import GatewayError

DONE_EVENT = b"data: [DONE]\n\n"


class _Reader:
    """Stateless: each event stands alone."""

    __slots__ = ()

    def read(self, event: str | None, data: str) -> StreamChunk:
        return parse_event_data(data)


_READER = _Reader()


class OpenAICompletionsFormat:
    """Chat completions or legacy completions."""

    can_stream = True

    def __init__(self, name: ApiName) -> None:
        assert name in ("chat", "completions")
        self.name: ApiName = name

    def parse(self, raw: bytes, limits: RequestLimits) -> ParsedRequest:
        return parse_request(
            raw,
            "chat" if self.name == "chat" else "completions",
            max_tokens_ceiling=limits.max_tokens_ceiling,
            max_n=limits.max_n,
        )

    def count_input(self, req: ParsedRequest, counter: TokenCounter, spec: TokenizerSpec) -> int:
        if self.name == "chat":
            n = count_with_template("chat", req.body, counter, spec)
            return n if n is not None else count_chat_request(req.body, counter, spec)
        return count_completion_prompt(req.body, counter)

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
        return rewrite_body(
            req,
            budget=budget,
            force_include_usage=force_usage,
            canonical_model=model,
            continuous_usage=continuous_usage,
            upstream_stream=upstream_stream,
            stream_interval=stream_interval,
        )

    def stream_reader(self) -> _Reader:
        return _READER

    def reassembles(self, req: ParsedRequest) -> bool:
        """Every request but a completions ``best_of`` above 1 (which cannot stream)."""
        best_of = req.body.get("best_of") if self.name == "completions" else None
        return not (isinstance(best_of, int) and best_of > 1)

    def reassembler(self) -> BufferedStream:
        return chat_reassembler() if self.name == "chat" else completion_reassembler()

    def json_usage(self, body: bytes) -> Usage | None:
        try:
            chunk = parse_event_data(body.decode("utf-8", "replace"))
        except (MalformedChunk, orjson.JSONDecodeError, RecursionError):
            return None
        return chunk.usage

    def error_body(self, err: GatewayError) -> bytes:
        return error_body(err)

    def error_headers(self, err: GatewayError) -> list[tuple[str, str]]:
        return error_headers(err)

    def cut_events(self, err: GatewayError) -> bytes:
        """``event: error`` with the OpenAI error object, and no ``data: [DONE]`` after it (a
        terminator would let clients that only look for it count the stream as a success)."""
        return openai_cut_event(err)


CHAT = OpenAICompletionsFormat("chat")
COMPLETIONS = OpenAICompletionsFormat("completions")
