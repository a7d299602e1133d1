"""Model name to token counter: loading the counter a :class:`TokenizerSpec` describes
(:func:`load_counter`) and :class:`TokenizerRegistry`, which loads every configured model's
counter once, when the configuration is compiled, sharing one counter between the models whose
specs name the same tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from extproc.core.counters import EstimateCounter, HuggingFaceCounter, TiktokenCounter
from extproc.core.tokens import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_PIECE_CHARS,
    TokenCounter,
    TokenizerSpec,
)
from extproc.tokenizers.fast_bpe import fast_counter
from extproc.tokenizers.huggingface import load_chat_template, load_huggingface_tokenizer
from extproc.tokenizers.tiktoken_files import (
    BUNDLED_ENCODING,
    bundled_encoding,
    load_tiktoken_encoding,
)

__all__ = ["TokenizerRegistry", "counter_key", "load_counter"]

_WARM_TEXT = (
    "Warm-up: the quick brown fox jumps over the lazy dog. "
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01 12345"
)


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
            encoding,
            name=name,
            max_chars=max_chars,
            max_piece_chars=max_piece_chars,
            fast=fast_counter(spec.encoding, encoding),
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
