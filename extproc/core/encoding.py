"""Response bodies that arrive compressed, and media types, decided purely.

Metered requests ask the upstream for identity encoding; a proxy may still compress.  gzip
and deflate are decoded incrementally here so the meter sees (and the client gets) plain
bytes; other encodings cannot be metered.
"""

from __future__ import annotations

import zlib


class UnsupportedEncoding(ValueError):  # reads as the condition it names
    """A content encoding the gateway cannot decode."""


class BodyDecoder:
    """Incremental gzip/deflate decoder."""

    __slots__ = ("_z",)

    def __init__(self, encoding: str) -> None:
        # 47 = auto-detect gzip or zlib headers; raw deflate (-15) is what some servers send.
        self._z = zlib.decompressobj(47 if encoding in ("gzip", "x-gzip") else 15 + 32)

    def feed(self, data: bytes) -> bytes:
        """Plain bytes for the compressed ``data`` (raises ``zlib.error`` on corrupt input)."""
        return self._z.decompress(data)

    def flush(self) -> bytes:
        """Whatever remains at the end of the body."""
        return self._z.flush()


def decoder_for(content_encoding: str) -> BodyDecoder | None:
    """None for identity; a decoder for gzip/deflate; :class:`UnsupportedEncoding` otherwise."""
    enc = [e.strip().lower() for e in content_encoding.split(",") if e.strip()]
    enc = [e for e in enc if e != "identity"]
    if not enc:
        return None
    if len(enc) == 1 and enc[0] in ("gzip", "x-gzip", "deflate"):
        return BodyDecoder(enc[0])
    raise UnsupportedEncoding(content_encoding)


def media_type(content_type: str) -> str:
    """``text/event-stream`` for ``Text/Event-Stream; charset=utf-8``; '' when absent."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    """``application/json`` or any ``+json`` type."""
    mt = media_type(content_type)
    return mt == "application/json" or mt.endswith("+json")
