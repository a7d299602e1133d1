"""Unit tests of the simulator's token-exact text generation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.sim.config import TEXT_MODES
from extproc.sim.text import count_tokens, encoding, generate_pieces, vocabulary

pytestmark = pytest.mark.unit

SEEDS = (0, 1, 7, 42, 2024, 987654321)


def test_every_vocabulary_piece_is_one_token() -> None:
    """Each verified piece encodes to exactly one cl100k_base token."""
    vocab = vocabulary()
    enc = encoding()
    for piece in (*vocab.english, *vocab.zh_spaced, *vocab.zh_bare, *vocab.fixed):
        assert len(enc.encode_ordinary(piece)) == 1, piece


def test_vocabulary_has_chinese_and_english() -> None:
    """The vocabulary keeps enough English words and Chinese characters after filtering."""
    vocab = vocabulary()
    assert len(vocab.english) >= 50
    assert len(vocab.zh_bare) >= 50
    assert len(vocab.zh_spaced) >= 10
    assert all(p.startswith(" ") for p in vocab.english)


@pytest.mark.parametrize("mode", TEXT_MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_generated_text_tokenizes_one_token_per_piece(mode: str, seed: int) -> None:
    """Joined pieces of every mode and seed tokenize to exactly len(pieces) tokens."""
    for choice in (0, 1, 3):
        pieces = generate_pieces(mode, seed, choice, 3000)
        assert len(pieces) == 3000
        assert count_tokens("".join(pieces)) == len(pieces)


@pytest.mark.parametrize("mode", TEXT_MODES)
def test_every_prefix_and_split_tokenizes_exactly(mode: str) -> None:
    """Any split point (reasoning/content, chunk boundary) keeps both halves token-exact."""
    pieces = generate_pieces(mode, 5, 0, 200)
    for cut in range(0, 201, 7):
        assert count_tokens("".join(pieces[:cut])) == cut
        assert count_tokens("".join(pieces[cut:])) == 200 - cut


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(TEXT_MODES),
    seed=st.integers(min_value=-(2**40), max_value=2**40),
    choice=st.integers(min_value=0, max_value=16),
    count=st.integers(min_value=0, max_value=400),
)
def test_token_exact_for_arbitrary_seeds(mode: str, seed: int, choice: int, count: int) -> None:
    """Property: any seed/choice/length yields text whose cl100k count equals the piece count."""
    pieces = generate_pieces(mode, seed, choice, count)
    assert len(pieces) == count
    assert count_tokens("".join(pieces)) == count


@pytest.mark.parametrize("mode", TEXT_MODES)
def test_generation_is_deterministic_and_prefix_stable(mode: str) -> None:
    """Same (mode, seed, choice) gives the same text; a shorter answer is a prefix."""
    a = generate_pieces(mode, 11, 0, 500)
    b = generate_pieces(mode, 11, 0, 500)
    assert a == b
    assert generate_pieces(mode, 11, 0, 123) == a[:123]


def test_seeds_and_choices_differ() -> None:
    """Different seeds or choice indexes give different text (except fixed mode)."""
    assert generate_pieces("mixed", 1, 0, 100) != generate_pieces("mixed", 2, 0, 100)
    assert generate_pieces("mixed", 1, 0, 100) != generate_pieces("mixed", 1, 1, 100)
    assert generate_pieces("fixed", 1, 0, 50) == generate_pieces("fixed", 2, 3, 50)


def test_modes_use_their_alphabets() -> None:
    """English mode has no CJK, Chinese mode is CJK only, mixed mode has both."""

    def has_cjk(text: str) -> bool:
        return any("\u4e00" <= ch <= "\u9fff" for ch in text)

    english = "".join(generate_pieces("english", 3, 0, 500))
    chinese = "".join(generate_pieces("chinese", 3, 0, 500))
    mixed = "".join(generate_pieces("mixed", 3, 0, 500))
    assert not has_cjk(english)
    assert all(ch == " " or "\u4e00" <= ch <= "\u9fff" for ch in chinese)
    assert has_cjk(mixed)
    assert any(ch.isascii() and ch.isalpha() for ch in mixed)


def test_unknown_mode_rejected() -> None:
    """An unknown text mode raises ValueError."""
    with pytest.raises(ValueError, match="unknown text mode"):
        generate_pieces("klingon", 0, 0, 5)
