"""The token counters over loaded tokenizers: :class:`TiktokenCounter` (a tiktoken
``Encoding``), :class:`HuggingFaceCounter` (a Hugging Face ``Tokenizer``, with the model's chat
template when it has one), :class:`EstimateCounter` (a character estimate, no tokenizer), and
:class:`UTF8BoundCounter`, a cheap upper bound on a tiktoken count (:func:`upper_bound_counter`).

Each implements :class:`extproc.core.tokens.TokenCounter` with the size ceiling and the splitting
rule of :mod:`extproc.core.tokens`.  Loading tokenizers from files is :mod:`extproc.tokenizers`'
job; this module never reads a file.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

from extproc.core.chat_template import ChatTemplate
from extproc.core.tokens import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_PIECE_CHARS,
    HARD_CUT_SLACK_TOKENS,
    TokenCounter,
    check_size,
    split_for_counting,
)

__all__ = [
    "EstimateCounter",
    "HuggingFaceCounter",
    "TiktokenCounter",
    "UTF8BoundCounter",
    "upper_bound_counter",
]


class TiktokenCounter:
    """Counts tokens with a tiktoken ``Encoding`` via ``encode_ordinary``.

    Special-token text such as ``<|endoftext|>`` in a prompt is counted as the ordinary
    text it is and never raises. Long texts are encoded in pieces
    (:func:`split_for_counting`); each forced cut adds ``HARD_CUT_SLACK_TOKENS``.

    ``fast``: a count of a text that equals ``len(encoding.encode_ordinary(text))`` and is
    cheaper but holds the GIL (``bpe-openai``, chosen and checked by
    :func:`extproc.tokenizers.fast_bpe.fast_counter`).  It counts the pieces on the main
    thread (the event loop's, which holds the GIL while it counts anyway); in any other thread
    (a large prompt offloaded so the loop keeps running) tiktoken counts, as it releases the GIL.
    The pieces and the result are the same either way.
    """

    def __init__(
        self,
        encoding: Any,
        *,
        name: str | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS,
        fast: Callable[[str], int] | None = None,
    ) -> None:
        """Wrap a loaded ``tiktoken.Encoding`` (and a faster equal count, if any)."""
        self.encoding = encoding
        self.name = name or f"tiktoken:{encoding.name}"
        self.max_chars = max_chars
        self.max_piece_chars = max_piece_chars
        self.fast = fast
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
        check_size(text, self.max_chars, self.name)
        fast = self.fast
        if fast is not None and threading.get_ident() == threading.main_thread().ident:
            if len(text) <= self.max_piece_chars:
                return fast(text)
            split = split_for_counting(text, self.max_piece_chars)
            return sum(map(fast, split.pieces)) + split.hard_cuts * HARD_CUT_SLACK_TOKENS
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
        check_size(text, self.max_chars, self.name)
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
        check_size(text, self.max_chars, self.name)
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
        check_size(text, self.max_chars, self.name)
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
