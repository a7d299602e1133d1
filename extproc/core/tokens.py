"""What token counting is, whatever the tokenizer: pure, and never reading a file.

The gateway admits a request on the number of input tokens it carries, counted with the
model's real tokenizer where one is configured.  This module holds what every counter and every
request walker shares: how a model is counted (:class:`TokenizerSpec`), what a counter is
(:class:`TokenCounter`; the implementations are in :mod:`extproc.core.counters`, loading them
from files is :mod:`extproc.tokenizers`' job), the errors (:class:`PromptTooLarge`,
:class:`PromptShapeError`, which the gateway maps to HTTP 400), and the per-delta counting of
streams (:func:`delta_counter`).

Counting is bounded. Very long runs without whitespace make BPE slow, so the counters encode
long texts in pieces cut at boundaries where the split is exact for tiktoken encodings (see
:func:`split_for_counting`); text longer than ``max_chars`` is refused (:func:`check_size`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import orjson

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_PIECE_CHARS",
    "PromptShapeError",
    "PromptTooLarge",
    "Split",
    "TokenCounter",
    "TokenizerSpec",
    "check_size",
    "count_stream_delta",
    "delta_counter",
    "split_for_counting",
]

#: Hard ceiling on the characters of one text handed to ``count`` (8 MiB).
DEFAULT_MAX_CHARS = 8 * 1024 * 1024
#: Longest piece encoded in one call; longer texts are split (see :func:`split_for_counting`).
DEFAULT_MAX_PIECE_CHARS = 2048
#: Tokens added per forced cut, so cutting never under-counts (a cut inside a run of mixed
#: whitespace can cost two: Hypothesis found 4 tokens counted as 2 + 1 under o200k's pattern).
HARD_CUT_SLACK_TOKENS = 2


class PromptTooLarge(ValueError):  # public name fixed by the API
    """A text is longer than the counter's ``max_chars`` ceiling."""


class PromptShapeError(ValueError):
    """A request body field has the wrong type; ``str(exc)`` names the field path."""


@dataclass(frozen=True)
class TokenizerSpec:
    """How to count tokens for one model, and the chat framing overhead to add.

    ``kind`` selects the counter: ``tiktoken`` (``encoding`` required, ``path`` to a
    ``.tiktoken`` file required for every encoding except the bundled ``cl100k_base``),
    ``huggingface`` (``path`` to a ``tokenizer.json``) or ``estimate``
    (``chars_per_token`` and ``safety_factor``).

    The chat overhead follows OpenAI's published rule for cl100k/o200k chat models:
    ``tokens_per_message`` per message, ``tokens_per_name`` extra when a message has a
    ``name``, ``reply_priming_tokens`` once per request. Images cost a conservative flat
    ``image_tokens`` each (765 is what a 1024x1024 high-detail image costs on gpt-4o-class
    models); audio and file parts cost ``audio_tokens`` / ``file_tokens`` each.
    """

    kind: Literal["tiktoken", "huggingface", "estimate"]
    encoding: str | None = None
    path: str | None = None
    chars_per_token: float = 3.0
    safety_factor: float = 1.25
    tokens_per_message: int = 3
    tokens_per_name: int = 1
    reply_priming_tokens: int = 3
    image_tokens: int = 765
    audio_tokens: int = 1000
    file_tokens: int = 1000

    def __post_init__(self) -> None:
        """Reject specs whose fields cannot describe a counter."""
        if self.kind not in ("tiktoken", "huggingface", "estimate"):
            raise ValueError(f"unknown tokenizer kind {self.kind!r}")
        if self.kind == "tiktoken" and not self.encoding:
            raise ValueError("a tiktoken tokenizer spec needs an encoding")
        if self.kind == "huggingface" and not self.path:
            raise ValueError("a huggingface tokenizer spec needs a path to tokenizer.json")
        if not (self.chars_per_token > 0 and math.isfinite(self.chars_per_token)):
            raise ValueError(f"chars_per_token must be positive, got {self.chars_per_token}")
        if not (self.safety_factor > 0 and math.isfinite(self.safety_factor)):
            raise ValueError(f"safety_factor must be positive, got {self.safety_factor}")
        for field in (
            "tokens_per_message",
            "tokens_per_name",
            "reply_priming_tokens",
            "image_tokens",
            "audio_tokens",
            "file_tokens",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be a non-negative integer, got {value!r}")


class TokenCounter(Protocol):
    """Anything that counts the tokens of a text."""

    name: str

    def count(self, text: str) -> int:
        """Return the number of tokens ``text`` encodes to."""
        ...


# --------------------------------------------------------------------------- splitting


class Split(NamedTuple):
    """Pieces of a text to encode separately, and how many cuts were forced."""

    pieces: list[str]
    hard_cuts: int


# Zero-width positions where cutting a text leaves every tiktoken pre-token (cl100k,
# o200k, p50k/r50k split patterns) intact, so the piece counts sum to the exact count:
#   * before a space or tab that follows a non-whitespace character;
#   * before a newline that follows a letter or digit;
#   * before common ASCII / CJK punctuation (not the apostrophe, which starts
#     contractions) that follows a letter or digit;
#   * between an ASCII letter and an ASCII digit, either way round.
# The leading greedy ``.*`` makes ``match`` return the LAST such position in a window.
_PUNCT = (
    r"!-&(-/:-@\[-`{-~"  # ASCII punctuation and symbols except the apostrophe
    "\u3001\u3002\u3008-\u3011\u3014-\u301f"  # CJK punctuation and brackets
    "\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"  # full-width forms
)
_SAFE_CUT = re.compile(
    r"(?s:.*)(?:"
    r"(?=[ \t])(?<=\S)"
    r"|(?=[\r\n" + _PUNCT + r"])(?<=[^\W_])"
    r"|(?=[0-9])(?<=[A-Za-z])"
    r"|(?=[A-Za-z])(?<=[0-9])"
    r")"
)


def split_for_counting(text: str, max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS) -> Split:
    """Split ``text`` into pieces of at most ``max_piece_chars`` characters.

    Each cut is placed at the last safe boundary (see ``_SAFE_CUT``) in the second to
    fourth quarter of the window, so summing tiktoken counts of the pieces equals the
    count of the whole text. Only when a window has no safe boundary (a long run of
    letters, CJK ideographs without punctuation, base64 ...) is the text cut at exactly
    ``max_piece_chars``; such a forced cut is counted in ``hard_cuts``.
    """
    if max_piece_chars < 4:
        raise ValueError("max_piece_chars must be at least 4")
    n = len(text)
    if n <= max_piece_chars:
        return Split([text], 0)
    pieces: list[str] = []
    hard_cuts = 0
    pos = 0
    while n - pos > max_piece_chars:
        end = pos + max_piece_chars
        lo = pos + max_piece_chars // 4
        # endpos=end+1 lets the lookahead see text[end]; the cut itself is always <= end.
        m = _SAFE_CUT.match(text, lo, end + 1)
        if m is not None and m.end() > pos:
            cut = m.end()
        else:
            cut = end
            hard_cuts += 1
        pieces.append(text[pos:cut])
        pos = cut
    pieces.append(text[pos:])
    return Split(pieces, hard_cuts)


def check_size(text: str, max_chars: int, name: str) -> None:
    """A :class:`TypeError` unless ``text`` is a string, a :class:`PromptTooLarge` when it is
    longer than ``max_chars`` (``name``: the counter, for the message)."""
    if not isinstance(text, str):
        raise TypeError(f"{name}: count() needs a str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise PromptTooLarge(
            f"text of {len(text)} characters exceeds the {max_chars}-character limit ({name})"
        )


# --------------------------------------------------------------------------- stream deltas


#: What a decoder puts in place of bytes that are not (yet) valid UTF-8.
REPLACEMENT_CHAR = "\ufffd"


def count_stream_delta(text: str, count: Callable[[str], int]) -> int:
    """Tokens of one streamed delta, each U+FFFD counted as one token.

    A byte-level model emits the bytes of a character that is not in its vocabulary (CJK,
    emoji) as separate tokens; the server's detokenizer shows a byte that is not valid UTF-8 as
    U+FFFD.  Re-encoding that character costs 1 to 3 tokens depending on the vocabulary, but the
    engine spent at most one token per replacement character (a token holding several invalid
    bytes yields one character per byte).  So the text between replacement characters is counted
    with ``count`` and each replacement character as one token; text without one is counted as
    it is.
    """
    if REPLACEMENT_CHAR not in text:
        return count(text)
    total = 0
    for piece in text.split(REPLACEMENT_CHAR):
        if piece:
            total += count(piece)
    return total + text.count(REPLACEMENT_CHAR)


def delta_counter(
    count: Callable[[str], int], *, max_len: int = 32, max_entries: int = 65_536
) -> Callable[[str], int]:
    """``count`` memoised for short texts, with :func:`count_stream_delta`'s rule for replacement
    characters: the per-delta counter of streams.

    Streamed deltas are short and repeat a lot (" the", ","); a dictionary hit costs far
    less than running the BPE, and keeps the tokenizer's large tables out of the CPU cache
    on the per-chunk path.  Exact: a hit returns what was computed for the same text.
    The table is cleared when it reaches ``max_entries``, so memory stays bounded.
    """
    cache: dict[str, int] = {}

    def counted(text: str) -> int:
        if len(text) > max_len:
            return count_stream_delta(text, count)
        n = cache.get(text)
        if n is None:
            if len(cache) >= max_entries:
                cache.clear()
            n = cache[text] = count_stream_delta(text, count)
        return n

    return counted


# --------------------------------------------------------------------------- requests


def json_text(value: Any) -> str:
    """Compact JSON of ``value`` (the form tool and schema definitions are counted in)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return str(value)


def require_text(value: Any, path: str) -> str:
    """``value`` when it is a string; a :class:`PromptShapeError` naming ``path`` when not."""
    if not isinstance(value, str):
        raise PromptShapeError(f"{path} must be a string")
    return value
