"""A faster exact count for ``cl100k_base`` and ``o200k_base``: the ``bpe-openai`` package (Python
bindings of GitHub's ``bpe-openai`` Rust crate: a linear-time pre-tokenizer and BPE encoder
that produce tiktoken's tokens for these two encodings).

Counting a 1k-token prompt takes about a third of tiktoken's time (77 against 225 µs on the
development machine), which is the largest single piece of the processor's own CPU per
non-streaming request (docs/performance.md, "CPU per request toward the floor").

It is used only where it is known to give tiktoken's answer:

- for the two encodings the package implements, and only when the encoding was loaded from the
  published BPE file (:func:`extproc.tokenizers.load_tiktoken_encoding` checks its sha256);
- when, at load, its token ids equal the loaded tiktoken encoding's on :data:`PROBE_TEXTS`
  (English, code, numbers, whitespace runs, contractions, CJK, emoji, replacement characters);
  any difference, or a missing or broken package, leaves the counter on tiktoken alone, with a
  warning (the ``bpe-openai`` dependency is pinned in ``pyproject.toml``);
- unless ``AIQ_FAST_BPE=0`` is set in the environment (tiktoken only).

Its calls hold the GIL (tiktoken releases it), so :class:`extproc.core.counters.TiktokenCounter`
uses it on the event loop's thread only, where a count holds the GIL anyway; a large prompt
counted in a worker thread still goes to tiktoken, so the loop keeps running meanwhile.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import structlog

__all__ = ["FAST_ENCODINGS", "PROBE_TEXTS", "fast_counter"]

log = structlog.get_logger("extproc")

#: The encodings ``bpe-openai`` implements (and this module may accelerate).
FAST_ENCODINGS = ("cl100k_base", "o200k_base")

#: Texts whose token ids must be tiktoken's for the fast counter to be used.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 12:45; we'll see, they've gone, I'd "
    "say IT'S DONE. Don't, won't, can't! Numbers: 1, 22, 333, 4444, 55555, 3.14159, -7e10.",
    "def count(text: str) -> int:\n    return len(enc.encode_ordinary(text))  # O(n)\n\n\n"
    "\tif x >= 0x1F and y != 'z':\n\t\tprint(f\"{x!r:>10}\")\r\n",
    "   leading spaces, trailing spaces   \n \n\n   \t \u00a0\u3000 mixed whitespace \n\n\n\n",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002"
    "\ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0440\u0443\u0441\u0441\u043a"
    "\u0438\u0439 \u00e9t\u00e9 Stra\u00dfe \u0393\u03b5\u03b9\u03ac \u0939\u093f\u0928\u094d"
    "\u0926\u0940",
    "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 "
    "\ufffd\ufffd replacement, zero\u200bwidth, <|endoftext|> <|fim_prefix|> special text",
    "https://example.com/a/b?c=d&e=f#g user@example.org $100.00 50% ~/path/to/file.py "
    "A1b2C3d4 ALLCAPSWORD camelCaseWord snake_case_word kebab-case-word ...!!!???",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    "0000000000000000000000000000000000000000 ---------------------------------------------",
)


def _disabled() -> bool:
    return os.environ.get("AIQ_FAST_BPE", "1").strip().lower() in ("0", "false", "no", "off")


@cache
def _bindings() -> Any:
    """The package's compiled module alone, or None when it is not installed.

    Loaded from its file rather than imported: importing ``bpe_openai`` runs its package
    ``__init__``, which builds tiktoken-style rank tables in Python for its compatibility layer
    (1.5 s and ~30 MB this module has no use for)."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.startswith("_bindings.") and name.endswith((".so", ".pyd")):
                found = importlib.util.spec_from_file_location(
                    "bpe_openai._bindings", os.path.join(folder, name)
                )
                if found is None or found.loader is None:
                    return None
                module = importlib.util.module_from_spec(found)
                found.loader.exec_module(module)
                return module
    return None


def fast_counter(encoding_name: str, encoding: Any) -> Callable[[str], int] | None:
    """``bpe-openai``'s count for ``encoding_name`` when it may stand in for ``encoding`` (a
    loaded tiktoken ``Encoding`` of that name); ``None`` otherwise (see the module's rules)."""
    if encoding_name not in FAST_ENCODINGS or _disabled():
        return None
    try:
        bindings = _bindings()
        if bindings is None:
            return None
        tokenizer = bindings.tokenizer_for_encoding(encoding_name)
        same = all(
            list(tokenizer.encode(text)) == encoding.encode_ordinary(text) for text in PROBE_TEXTS
        )
    except Exception as exc:  # a broken build: tiktoken alone, said once
        log.warning("fast_bpe_unavailable", encoding=encoding_name, error=str(exc))
        return None
    if not same:
        log.warning("fast_bpe_differs", encoding=encoding_name)
        return None
    count: Callable[[str], int] = tokenizer.count
    return count
