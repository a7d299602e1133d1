"""Token counting for quota admission: pure, over tokenizers loaded elsewhere.

The gateway admits a request on the number of input tokens it carries, counted with the
model's real tokenizer where one is configured: a tiktoken ``Encoding``
(:class:`TiktokenCounter`), a Hugging Face ``Tokenizer`` (:class:`HuggingFaceCounter`), or a
conservative character-based estimate (:class:`EstimateCounter`). Loading them from files is
:mod:`extproc.tokenizers`' job; this module never reads a file.

Counting is bounded. Very long runs without whitespace make BPE slow, so
:meth:`TiktokenCounter.count` and :meth:`HuggingFaceCounter.count` encode long texts in
pieces cut at boundaries where the split is exact for tiktoken encodings (see
:func:`split_for_counting`); text longer than ``max_chars`` is refused with
:class:`PromptTooLarge`.

:func:`count_chat_request` and :func:`count_completion_prompt` walk OpenAI-style request
bodies and add the chat framing overhead; malformed bodies raise
:class:`PromptShapeError`, which the gateway maps to HTTP 400.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import orjson

if TYPE_CHECKING:
    from extproc.core.chat_template import ChatTemplate

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_PIECE_CHARS",
    "EstimateCounter",
    "HuggingFaceCounter",
    "PromptShapeError",
    "PromptTooLarge",
    "Split",
    "TiktokenCounter",
    "TokenCounter",
    "TokenizerSpec",
    "UTF8BoundCounter",
    "count_stream_delta",
    "delta_counter",
    "split_for_counting",
    "upper_bound_counter",
]

#: Hard ceiling on the characters of one text handed to ``count`` (8 MiB).
DEFAULT_MAX_CHARS = 8 * 1024 * 1024
#: Longest piece encoded in one call; longer texts are split (see :func:`split_for_counting`).
DEFAULT_MAX_PIECE_CHARS = 2048
#: Tokens added per forced cut inside a whitespace-free run, so cutting never under-counts.
HARD_CUT_SLACK_TOKENS = 1


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


def _check_size(text: str, max_chars: int, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name}: count() needs a str, got {type(text).__name__}")
    if len(text) > max_chars:
        raise PromptTooLarge(
            f"text of {len(text)} characters exceeds the {max_chars}-character limit ({name})"
        )


# --------------------------------------------------------------------------- counters


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


class TiktokenCounter:
    """Counts tokens with a tiktoken ``Encoding`` via ``encode_ordinary``.

    Special-token text such as ``<|endoftext|>`` in a prompt is counted as the ordinary
    text it is and never raises. Long texts are encoded in pieces
    (:func:`split_for_counting`); each forced cut adds ``HARD_CUT_SLACK_TOKENS``.
    """

    def __init__(
        self,
        encoding: Any,
        *,
        name: str | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS,
    ) -> None:
        """Wrap a loaded ``tiktoken.Encoding``."""
        self.encoding = encoding
        self.name = name or f"tiktoken:{encoding.name}"
        self.max_chars = max_chars
        self.max_piece_chars = max_piece_chars
        self._longest: int | None = None

    @property
    def longest_token_bytes(self) -> int:
        """The most bytes one ordinary token of the encoding stands for, read from its
        vocabulary once (cl100k_base: 128, a run of spaces): a text of ``b`` bytes has at
        least ``b / longest_token_bytes`` tokens."""
        longest = self._longest
        if longest is None:
            longest = max((len(t) for t in self.encoding.token_byte_values()), default=1)
            self._longest = longest
        return longest

    def count(self, text: str) -> int:
        """Return the token count of ``text`` (exact unless a forced cut was needed)."""
        _check_size(text, self.max_chars, self.name)
        if len(text) <= self.max_piece_chars:
            return len(self.encoding.encode_ordinary(text))
        split = split_for_counting(text, self.max_piece_chars)
        encode = self.encoding.encode_ordinary
        total = sum(len(encode(piece)) for piece in split.pieces)
        return total + split.hard_cuts * HARD_CUT_SLACK_TOKENS

    def __repr__(self) -> str:
        """Show which encoding this counter uses."""
        return f"TiktokenCounter({self.name!r})"


class UTF8BoundCounter:
    """An upper bound on what a :class:`TiktokenCounter` counts, without running the BPE.

    tiktoken encodes the UTF-8 bytes of a text and every token stands for at least one byte,
    so a text never has more tokens than bytes; a forced cut (:func:`split_for_counting`)
    adds at most ``HARD_CUT_SLACK_TOKENS`` per piece.  Walking a request with this counter in
    place of the real one gives an upper bound on its exact count (the framing constants are
    the same, every text is counted at least as high) and raises the same shape and size
    errors: admission can decide on it when the answer cannot change."""

    def __init__(self, inner: TiktokenCounter) -> None:
        """Bound ``inner``'s counts (same size ceiling and piece length)."""
        self.inner = inner
        self.name = f"utf8-bound:{inner.name}"
        self.max_chars = inner.max_chars
        self.max_piece_chars = inner.max_piece_chars
        # read from the vocabulary here, when the configuration is compiled (not on a request)
        self.longest_token_bytes = inner.longest_token_bytes

    def count(self, text: str) -> int:
        """At least ``inner.count(text)``: the UTF-8 length, plus each possible cut's slack."""
        _check_size(text, self.max_chars, self.name)
        n = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if len(text) > self.max_piece_chars:
            n += (len(text) // self.max_piece_chars + 1) * HARD_CUT_SLACK_TOKENS
        return n

    def fewest_tokens(self, bound: int) -> int:
        """The fewest tokens the inner counter can count for a request whose walk with this
        counter gave ``bound``: each token stands for at most ``longest_token_bytes`` bytes,
        and the slack :meth:`count` adds for a text longer than a piece is at most
        ``2 * HARD_CUT_SLACK_TOKENS / max_piece_chars`` per byte; a framing constant is the
        same in both walks.  An upstream input figure below what the exact path would accept
        for this many tokens cannot be right."""
        pieces = self.max_piece_chars
        per_byte = self.longest_token_bytes * (pieces + 2 * HARD_CUT_SLACK_TOKENS)
        return max(0, bound) * pieces // per_byte

    def __repr__(self) -> str:
        """Show which counter this bounds."""
        return f"UTF8BoundCounter({self.inner.name!r})"


def upper_bound_counter(counter: TokenCounter) -> TokenCounter | None:
    """A cheap counter whose count of any text is at least ``counter``'s, or None where no
    such bound is proven: a Hugging Face tokenizer may normalise text into more bytes (NFKC
    expands some characters many times) or add a prefix per piece, and a chat template
    renders text of its own; an estimate is already as cheap as a bound."""
    if type(counter) is TiktokenCounter:
        return UTF8BoundCounter(counter)
    return None


class HuggingFaceCounter:
    """Counts tokens with a Hugging Face ``tokenizers.Tokenizer``, without special tokens.

    Special-token text in the input (``<|user|>``) is one token each, as the tokenizer (and the
    model server) reads it.  Long texts are first cut around special-token text, which the
    tokenizer never merges with its neighbours (so the cut is exact), then encoded in pieces
    like :class:`TiktokenCounter`; for pre-tokenizers that mark word starts (SentencePiece
    ``▁``) such a piece cut may add about one token per piece, which only ever over-counts.

    ``chat_template``: the model's compiled chat template when its ``tokenizer_config.json``
    has one (:mod:`extproc.core.chat_template` counts chat input by rendering it).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        """Wrap a loaded ``tokenizers.Tokenizer``."""
        self.tokenizer = tokenizer
        self.name = name
        self.max_chars = max_chars
        self.max_piece_chars = max_piece_chars
        self.chat_template = chat_template
        self._specials = _special_pattern(tokenizer)

    def _encode_len(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _count_plain(self, text: str) -> int:
        if len(text) <= self.max_piece_chars:
            return self._encode_len(text)
        split = split_for_counting(text, self.max_piece_chars)
        total = sum(self._encode_len(piece) for piece in split.pieces)
        return total + split.hard_cuts * HARD_CUT_SLACK_TOKENS

    def count(self, text: str) -> int:
        """Return the token count of ``text`` without the tokenizer's special tokens."""
        _check_size(text, self.max_chars, self.name)
        if len(text) <= self.max_piece_chars:
            return self._encode_len(text)
        if self._specials is None:
            return self._count_plain(text)
        total = 0
        pos = 0
        for m in self._specials.finditer(text):
            if m.start() > pos:
                total += self._count_plain(text[pos : m.start()])
            total += 1
            pos = m.end()
        if pos < len(text):
            total += self._count_plain(text[pos:])
        return total

    def __repr__(self) -> str:
        """Show which tokenizer file this counter uses."""
        return f"HuggingFaceCounter({self.name!r})"


def _special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A pattern matching the tokenizer's special-token texts (longest first), or None."""
    get = getattr(tokenizer, "get_added_tokens_decoder", None)
    if get is None:
        return None
    texts = sorted(
        {t.content for t in get().values() if getattr(t, "special", False) and t.content},
        key=len,
        reverse=True,
    )
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in texts))


class EstimateCounter:
    """Conservative token estimate for models without a loadable tokenizer.

    ASCII characters count ``1 / chars_per_token`` tokens each; every non-ASCII character
    (CJK, Cyrillic, emoji, ...) counts one full token, since BPE vocabularies give such
    text about one token per character or more. The sum is multiplied by
    ``safety_factor`` and rounded up, so the estimate leans towards over-counting.
    """

    def __init__(
        self,
        chars_per_token: float = 3.0,
        safety_factor: float = 1.25,
        *,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        """Configure the ratio and the safety multiplier."""
        if not chars_per_token > 0 or not safety_factor > 0:
            raise ValueError("chars_per_token and safety_factor must be positive")
        self.chars_per_token = chars_per_token
        self.safety_factor = safety_factor
        self.max_chars = max_chars
        self.name = f"estimate:{chars_per_token:g}cpt*{safety_factor:g}"

    def count(self, text: str) -> int:
        """Return the estimated token count of ``text``."""
        _check_size(text, self.max_chars, self.name)
        if not text:
            return 0
        ascii_chars = len(text) if text.isascii() else len(text.encode("ascii", "ignore"))
        other_chars = len(text) - ascii_chars
        raw = ascii_chars / self.chars_per_token + other_chars
        # Round away float noise before ceil so 6 chars / 3.0 * 1.0 is 2, not 3.
        return math.ceil(round(raw * self.safety_factor, 9))

    def __repr__(self) -> str:
        """Show the estimate parameters."""
        return f"EstimateCounter({self.name!r})"


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
