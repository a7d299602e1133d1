"""The admin side's own error (no imports: ``ai-quota serve`` catches it cheaply)."""

from __future__ import annotations


class AdminConfigError(ValueError):
    """The admin server's settings are unsafe or incomplete; the message says what to set."""
