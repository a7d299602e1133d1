"""The real ``openai`` and ``anthropic`` SDKs against a tiny local SSE server that replays the
recorded-style streams of ``tests/data/sse/`` and the bytes the API formats render: a normal
stream is read to its end, a stream cut with ``cut_events(...)`` and then aborted the way the
gateway aborts it (the HTTP/1.1 body ends without its last chunk) makes the SDK raise the
gateway's message as an API error, not a transport error, and an admission 429 from ``error_body``/``error_headers`` becomes the
SDK's ``RateLimitError`` with ``retry-after`` readable.

Why the Responses cut carries an ``error`` object besides the documented top-level ``code`` /
``message``: the openai SDK only raises for stream data with a non-empty ``error``; the plain
documented shape is yielded as a ``ResponseErrorEvent`` and iteration carries on.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import anthropic
import openai
import pytest

from extproc.core.apis.embeddings import EMBEDDINGS
from extproc.core.apis.messages import MESSAGES
from extproc.core.apis.openai import CHAT, COMPLETIONS
from extproc.core.apis.responses import RESPONSES, ResponsesReader
from extproc.errors import QuotaExceeded, RateLimitHeaders, StreamCut
from tests.apis_support import sse_bytes

pytestmark = pytest.mark.integration

CUT = StreamCut(
    "Rate limit reached for tokens per minute on tenant acme (tenant): limit 2000, used 2011. "
    "The stream was stopped after 7 output tokens; the limit resets in 41s.",
    status=429,
    error_type="tokens",
    code="tpm_limit_exceeded",
)
QUOTA = QuotaExceeded(
    "Rate limit reached for requests per minute on tenant acme: limit 5, used 5.",
    metric="rpm",
    retry_after_s=7.3,
    headers=RateLimitHeaders(
        limit_requests=5,
        remaining_requests=0,
        reset_requests_s=7.3,
        limit_tokens=2000,
        remaining_tokens=800,
        reset_tokens_s=30.0,
    ),
)
NOW_MS = 1_714_564_800_000


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: list[bytes]
    abort: bool = False  # chunked, and the connection closes before the last chunk


@dataclass
class Upstream:
    """What the server answers next, and the headers of the requests it saw."""

    port: int
    replies: dict[str, Reply] = field(default_factory=dict)
    seen: list[dict[str, str]] = field(default_factory=list)

    def stream(self, path: str, *pieces: bytes, abort: bool = False) -> None:
        self.replies[path] = Reply(
            200,
            [("content-type", "text/event-stream"), ("cache-control", "no-cache")],
            list(pieces),
            abort,
        )

    def cut(self, path: str, *pieces: bytes) -> None:
        """``pieces`` (the cut event last), then the abort the gateway sends after a cut."""
        self.stream(path, *pieces, abort=True)

    def error(self, path: str, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.replies[path] = Reply(status, headers, [body])


def _handler(upstream: Upstream) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", "0"))
            self.rfile.read(length)
            upstream.seen.append({k.lower(): v for k, v in self.headers.items()})
            reply = upstream.replies[self.path]
            self.send_response(reply.status)
            for name, value in reply.headers:
                self.send_header(name, value)
            self.send_header("connection", "close")
            if reply.abort:
                self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for piece in reply.body:  # one write per piece, flushed: a real stream
                chunk = b"%x\r\n%s\r\n" % (len(piece), piece) if reply.abort else piece
                self.wfile.write(chunk)
                self.wfile.flush()
            self.close_connection = True  # an aborted body never gets its 0-length chunk

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture(scope="module")
def server() -> Iterator[Upstream]:
    upstream = Upstream(port=0)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(upstream))
    upstream.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield upstream
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture
def upstream(server: Upstream) -> Upstream:
    server.replies.clear()
    server.seen.clear()
    return server


def oai(upstream: Upstream) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{upstream.port}/v1", api_key="sk-test", max_retries=0
    )


def claude(upstream: Upstream) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{upstream.port}", api_key="sk-ant-test", max_retries=0
    )


def events(name: str) -> list[bytes]:
    """The events of a recorded stream, each with its blank-line terminator."""
    return [e + b"\n\n" for e in sse_bytes(name).split(b"\n\n") if e.strip()]


def responses_prefix(count: int) -> tuple[list[bytes], int]:
    """The first ``count`` events of the text stream and their last sequence number."""
    prefix = events("responses_text.sse")[:count]
    reader = ResponsesReader()
    for ev in prefix:
        reader.read(None, ev.split(b"data: ", 1)[1].decode())
    assert reader.last_sequence_number is not None
    return prefix, reader.last_sequence_number


# --------------------------------------------------------------------------- chat, completions


def test_chat_cut_raises_api_error_with_the_message(upstream: Upstream) -> None:
    """The chat cut (event: error, comment, error data, abort) is the SDK's APIError."""
    prefix = events("chat_include_usage.sse")[:4]
    upstream.cut("/v1/chat/completions", *prefix, CHAT.cut_events(CUT))
    received: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in oai(upstream).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
    assert not isinstance(info.value, openai.APIConnectionError)
    assert info.value.message == CUT.message
    assert info.value.code == "tpm_limit_exceeded"
    assert received  # the deltas before the cut reached the caller


def test_chat_stream_helper_raises_on_the_cut(upstream: Upstream) -> None:
    """``chat.completions.stream`` raises the cut as an APIError too."""
    upstream.cut(
        "/v1/chat/completions", *events("chat_include_usage.sse")[:3], CHAT.cut_events(CUT)
    )
    with (
        pytest.raises(openai.APIError, match="resets in 41s") as info,
        oai(upstream).chat.completions.stream(
            model="m", messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        for _ in stream:
            pass
    assert not isinstance(info.value, openai.APIConnectionError)


async def test_chat_async_client_raises_on_the_cut(upstream: Upstream) -> None:
    """The async client raises the same APIError before it notices the aborted body."""
    upstream.cut(
        "/v1/chat/completions", *events("chat_include_usage.sse")[:2], CHAT.cut_events(CUT)
    )
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{upstream.port}/v1", api_key="sk-test", max_retries=0
    )
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    assert not isinstance(info.value, openai.APIConnectionError)
    assert info.value.message == CUT.message
    await client.close()


def test_completions_cut_raises_api_error(upstream: Upstream) -> None:
    """Legacy completions end a cut the same way, and the SDK raises it."""
    upstream.cut("/v1/completions", *events("completions.sse")[:2], COMPLETIONS.cut_events(CUT))
    with pytest.raises(openai.APIError) as info:
        for _ in oai(upstream).completions.create(model="m", prompt="once", stream=True):
            pass
    assert info.value.message == CUT.message


# --------------------------------------------------------------------------- Responses


def test_responses_normal_stream_reads_to_the_end(upstream: Upstream) -> None:
    upstream.stream("/v1/responses", *events("responses_text.sse"))
    stream = oai(upstream).responses.create(model="m", input="tides?", stream=True)
    seen = list(stream)
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == "Tides rise and fall twice a day, pulled by the Moon."
    assert seen[-1].type == "response.completed"
    assert seen[-1].response.usage is not None
    assert seen[-1].response.usage.output_tokens == 13


def test_responses_cut_raises_api_error(upstream: Upstream) -> None:
    prefix, last = responses_prefix(9)  # created, in_progress, item, part, 5 deltas
    upstream.cut("/v1/responses", *prefix, RESPONSES.cut_events(CUT, sequence_number=last))
    received = []
    with pytest.raises(openai.APIError) as info:
        for event in oai(upstream).responses.create(model="m", input="tides?", stream=True):
            if event.type == "response.output_text.delta":
                received.append(event.delta)
    assert info.value.message == CUT.message
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "tpm_limit_exceeded"
    assert info.value.code == "tpm_limit_exceeded"
    assert "".join(received) == "Tides rise and fall twice"


def test_responses_stream_helper_raises_on_the_cut(upstream: Upstream) -> None:
    prefix, last = responses_prefix(7)
    upstream.cut("/v1/responses", *prefix, RESPONSES.cut_events(CUT, sequence_number=last))
    with (
        pytest.raises(openai.APIError, match="resets in 41s"),
        oai(upstream).responses.stream(model="m", input="tides?") as stream,
    ):
        for _ in stream:
            pass


async def test_responses_async_client_raises_on_the_cut(upstream: Upstream) -> None:
    prefix, last = responses_prefix(6)
    upstream.cut("/v1/responses", *prefix, RESPONSES.cut_events(CUT, sequence_number=last))
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{upstream.port}/v1", api_key="sk-test", max_retries=0
    )
    stream = await client.responses.create(model="m", input="tides?", stream=True)
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    assert info.value.message == CUT.message
    await client.close()


def test_responses_429_is_a_rate_limit_error(upstream: Upstream) -> None:
    upstream.error(
        "/v1/responses", 429, RESPONSES.error_body(QUOTA), RESPONSES.error_headers(QUOTA)
    )
    with pytest.raises(openai.RateLimitError) as info:
        oai(upstream).responses.create(model="m", input="hi", stream=True)
    err = info.value
    assert err.status_code == 429
    assert err.code == "rpm_limit_exceeded"
    assert QUOTA.message in err.message
    assert err.response.headers["retry-after"] == "8"
    assert err.response.headers["x-ratelimit-remaining-requests"] == "0"


def test_embeddings_429_is_a_rate_limit_error(upstream: Upstream) -> None:
    upstream.error(
        "/v1/embeddings", 429, EMBEDDINGS.error_body(QUOTA), EMBEDDINGS.error_headers(QUOTA)
    )
    with pytest.raises(openai.RateLimitError) as info:
        oai(upstream).embeddings.create(model="e", input="hi")
    assert info.value.response.headers["retry-after"] == "8"


# --------------------------------------------------------------------------- Messages


def test_messages_normal_stream_and_key_header(upstream: Upstream) -> None:
    upstream.stream("/v1/messages", *events("messages_text.sse"))
    with claude(upstream).messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "capital?"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello! The capital of France is Paris."
    assert final.usage.input_tokens == 25 and final.usage.output_tokens == 9
    assert final.stop_reason == "end_turn"
    # Anthropic's API documents x-api-key, but this SDK (anthropic 2.x) sends the key as a
    # bearer token: a gateway must accept the key from either header on /v1/messages
    sent = upstream.seen[-1]
    assert sent.get("x-api-key") == "sk-ant-test" or sent.get("authorization") == (
        "Bearer sk-ant-test"
    )
    assert "anthropic-version" in sent


def test_messages_create_stream_raises_on_the_cut(upstream: Upstream) -> None:
    prefix = events("messages_text.sse")[:6]  # start, block start, ping, 3 deltas
    upstream.cut("/v1/messages", *prefix, MESSAGES.cut_events(CUT))
    received = []
    with pytest.raises(anthropic.APIStatusError) as info:
        for event in claude(upstream).messages.create(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": "capital?"}],
            stream=True,
        ):
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                received.append(event.delta.text)
    assert received == ["Hello", "!", " The"]
    assert CUT.message in str(info.value)
    assert info.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": CUT.message},
    }


def test_messages_stream_helper_raises_on_the_cut(upstream: Upstream) -> None:
    prefix = events("messages_thinking_tool.sse")[:10]
    upstream.cut("/v1/messages", *prefix, MESSAGES.cut_events(CUT))
    with (
        pytest.raises(anthropic.APIStatusError, match="resets in 41s"),
        claude(upstream).messages.stream(
            model="m", max_tokens=64, messages=[{"role": "user", "content": "weather?"}]
        ) as stream,
    ):
        stream.get_final_message()


async def test_messages_async_client_raises_on_the_cut(upstream: Upstream) -> None:
    upstream.cut("/v1/messages", *events("messages_text.sse")[:4], MESSAGES.cut_events(CUT))
    client = anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{upstream.port}", api_key="k", max_retries=0
    )
    stream = await client.messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}], stream=True
    )
    with pytest.raises(anthropic.APIStatusError) as info:
        async for _ in stream:
            pass
    assert CUT.message in str(info.value)
    await client.close()


def test_messages_429_is_a_rate_limit_error(upstream: Upstream) -> None:
    headers = MESSAGES.error_headers(QUOTA, now_ms=NOW_MS)
    upstream.error("/v1/messages", 429, MESSAGES.error_body(QUOTA), headers)
    with pytest.raises(anthropic.RateLimitError) as info:
        claude(upstream).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    err = info.value
    assert err.status_code == 429
    assert QUOTA.message in err.message
    assert err.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": QUOTA.message},
    }
    assert err.response.headers["retry-after"] == "8"
    assert err.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert err.response.headers["anthropic-ratelimit-requests-reset"] == "2024-05-01T12:00:08Z"


def test_messages_400_for_missing_max_tokens_is_a_bad_request(upstream: Upstream) -> None:
    from extproc.core.apis.base import RequestLimits
    from extproc.errors import BadRequest

    with pytest.raises(BadRequest) as refused:
        MESSAGES.parse(
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
            RequestLimits(max_tokens_ceiling=100, max_n=1),
        )
    err = refused.value
    upstream.error(
        "/v1/messages", err.status, MESSAGES.error_body(err), MESSAGES.error_headers(err)
    )
    with pytest.raises(anthropic.BadRequestError) as info:
        claude(upstream).messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert "max_tokens" in info.value.message
