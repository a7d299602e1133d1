"""What goes wrong loading a tokenizer: :class:`TokenizerLoadError`, and :func:`where`, the
part of its message that names the model, encoding and file."""

from __future__ import annotations


class TokenizerLoadError(ValueError):
    """A tokenizer named in the configuration cannot be loaded."""


def where(model: str | None, encoding: str | None, path: str | None) -> str:
    """``model 'm', encoding 'e', path 'p'`` (or ``no path``): what a load error is about."""
    parts = []
    if model is not None:
        parts.append(f"model {model!r}")
    if encoding is not None:
        parts.append(f"encoding {encoding!r}")
    parts.append(f"path {path!r}" if path is not None else "no path")
    return ", ".join(parts)
