"""Streamed deltas recounted by the gateway (extproc.core.tokens.count_stream_delta): text as the
tokenizer counts it, each U+FFFD (a byte the engine emitted that is not valid UTF-8 on its own)
one token, and the recount of a simulated engine stream (extproc.bench.stream_drift) close to
the tokens generated."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.bench import stream_drift as sd
from extproc.core.tokens import REPLACEMENT_CHAR, count_stream_delta, delta_counter
from extproc.tokenizers import bundled_encoding

pytestmark = pytest.mark.unit

ENC = bundled_encoding()


def cl100k(text: str) -> int:
    """cl100k_base count of ``text``."""
    return len(ENC.encode_ordinary(text))


clean_text = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters=REPLACEMENT_CHAR), max_size=40
)


@settings(max_examples=300, deadline=None)
@given(clean_text)
def test_text_without_replacement_is_counted_as_is(text: str) -> None:
    """A delta without U+FFFD costs exactly what the tokenizer says."""
    assert count_stream_delta(text, cl100k) == cl100k(text)
    assert delta_counter(cl100k)(text) == cl100k(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(clean_text, min_size=1, max_size=5), st.lists(st.integers(1, 4), max_size=4))
def test_each_replacement_char_is_one_token(pieces: list[str], runs: list[int]) -> None:
    """Replacement characters cost one token each; the text around them is counted alone."""
    text = pieces[0]
    expected = cl100k(pieces[0])
    for piece, run in zip(pieces[1:], runs, strict=False):
        text += REPLACEMENT_CHAR * run + piece
        expected += run + cl100k(piece)
    assert count_stream_delta(text, cl100k) == expected
    assert delta_counter(cl100k)(text) == expected


def test_a_lone_replacement_is_one_token_not_three() -> None:
    """The byte-level BPE spells U+FFFD as three bytes; the engine spent one token on it."""
    tok = sd.train_bpe(["plain ascii only " * 50], vocab_size=300)
    count = sd.bpe_engine(tok).count
    assert count(REPLACEMENT_CHAR) == 3
    assert count_stream_delta(REPLACEMENT_CHAR, count) == 1
    assert count_stream_delta("ab" + REPLACEMENT_CHAR * 2, count) == count("ab") + 2


@pytest.fixture(scope="module")
def bpe() -> Any:
    """The drift bench's byte-level BPE, trained on its training half."""
    return sd.train_bpe(list(sd.texts(0, 20_000).values()) * 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_token_streams_are_never_undercounted_much(bpe: Any, seed: int) -> None:
    """Random ids (a random-weight model), decoded as the engine does: the recount stays within
    [-1 token, +35 %] of the tokens generated, and under the plain recount."""
    engine = sd.bpe_engine(bpe)
    rng = random.Random(seed)
    ids = [rng.randrange(engine.vocab) for _ in range(200)]
    deltas = [d for d in engine.deltas(ids) if d]
    ours = sum(count_stream_delta(d, engine.count) for d in deltas)
    plain = sum(engine.count(d) for d in deltas)
    assert len(ids) - 1 <= ours <= len(ids) * 1.35
    assert ours <= plain


@pytest.mark.parametrize("category", ["english", "code", "chinese", "emoji"])
def test_canonical_text_streams_recount_within_a_token(bpe: Any, category: str) -> None:
    """A model emitting the canonical tokens of natural text, code, CJK or emoji is recounted
    within one token per 200-token response, on both tokenizers."""
    text = sd.texts(1, 6_000)[category]
    for engine in (sd.bpe_engine(bpe), sd.tiktoken_engine()):
        ids = engine.encode(text)
        for start in range(0, len(ids), 200):
            response = ids[start : start + 200]
            counted = sum(count_stream_delta(d, engine.count) for d in engine.deltas(response))
            assert abs(counted - len(response)) <= 1, (engine.name, category, start)


def test_byte_deltas_hold_back_incomplete_characters() -> None:
    """The simulated detokenizer emits a character only once all its bytes arrived."""
    pieces = [b"a", b"\xe4", b"\xbd", b"\xa0", b"b"]  # a, 你 in three byte tokens, b
    assert sd.byte_deltas(pieces.__getitem__, range(5)) == ["a", "", "", "\u4f60", "b"]
    # an engine cut mid-character flushes what it held as a replacement
    assert sd.byte_deltas(pieces.__getitem__, range(3)) == ["a", "", REPLACEMENT_CHAR]
