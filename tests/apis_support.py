"""Shared by the API-format tests: the bundled cl100k counter, recorded SSE files read through a
format's stream reader, and a summary of what the reader saw."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from extproc.core.apis.base import StreamReader
from extproc.core.chunks import StreamChunk, Usage
from extproc.core.sse import SSEDecoder
from extproc.core.tokens import TokenCounter, TokenizerSpec

SSE_DIR = Path(__file__).resolve().parent / "data" / "sse"
CL100K = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")


@functools.cache
def cl100k() -> TokenCounter:
    """The bundled cl100k_base counter (the one place the tests load it)."""
    from extproc.tokenizers import load_counter

    return load_counter(CL100K)


def sse_bytes(name: str) -> bytes:
    """The bytes of ``tests/data/sse/<name>``."""
    return (SSE_DIR / name).read_bytes()


@dataclass
class Transcript:
    """What a reader made of a whole stream."""

    chunks: list[StreamChunk] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    pieces: int = 0
    usage: Usage | None = None
    done_at: int | None = None
    errors: list[dict[str, object]] = field(default_factory=list)
    finish: list[tuple[int, str]] = field(default_factory=list)


def read_stream(reader: StreamReader, raw: bytes, *, chunk_size: int = 97) -> Transcript:
    """Feed ``raw`` through the SSE decoder in ``chunk_size`` pieces and ``reader`` event by
    event; the last usage seen wins (as in the meter)."""
    decoder = SSEDecoder()
    events = []
    for i in range(0, len(raw), chunk_size):
        events += decoder.feed(raw[i : i + chunk_size])
    events += decoder.flush()
    out = Transcript()
    for n, ev in enumerate(events):
        if ev.data is None:
            continue
        chunk = reader.read(ev.event, ev.data)
        out.chunks.append(chunk)
        for index, text in chunk.texts:
            out.texts[index] = out.texts.get(index, "") + text
            out.pieces += 1
        if chunk.usage is not None:
            out.usage = chunk.usage
        if chunk.error is not None:
            out.errors.append(chunk.error)
        out.finish += chunk.finish_reasons
        if chunk.done and out.done_at is None:
            out.done_at = n
    return out
