"""``aiquota.v1.Limit`` messages to and from the rules file's limit entries (plain mappings)."""

from __future__ import annotations

from typing import Any

from extproc.config import schema

_STRINGS = ("model", "scope", "per", "time_zone", "currency", "window")
_OPTIONAL = ("rpm", "tpm", "budget", "weighted_tokens", "concurrency")
_WEIGHTS = ("input", "cached_input", "output", "reasoning")


def limit_to_mapping(msg: Any) -> dict[str, Any]:
    """A ``Limit`` message as a rules-file entry: empty strings and unset numbers are left out
    (the file's defaults apply)."""
    out: dict[str, Any] = {}
    for name in _STRINGS:
        value = getattr(msg, name)
        if value:
            out[name] = value
    for name in _OPTIONAL:
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    if msg.HasField("weights"):
        out["weights"] = {n: getattr(msg.weights, n) for n in _WEIGHTS if msg.weights.HasField(n)}
    if msg.shadow:
        out["shadow"] = True
    return out


def limit_to_message(entry: schema.LimitEntry, cls: Any) -> Any:
    """A rules-file limit entry as a ``Limit`` message (``cls``) with every field filled."""
    msg = cls(
        model=entry.model,
        scope=entry.scope,
        per=entry.per,
        time_zone=entry.time_zone,
        currency=entry.currency or "",
        shadow=entry.shadow,
        window=entry.window,
    )
    for name in _OPTIONAL:
        value = getattr(entry, name)
        if value is not None:
            setattr(msg, name, value)
    if entry.weights is not None:
        for name in _WEIGHTS:
            value = getattr(entry.weights, name)
            if value is not None:
                setattr(msg.weights, name, value)
    return msg
