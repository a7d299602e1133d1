"""Checks on JSON values every API codec makes (the bottom of the core: imports nothing)."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """A JSON integer (``bool`` is an ``int`` subclass in Python, and not one in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)
