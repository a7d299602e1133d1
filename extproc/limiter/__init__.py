"""The limiter boundary: one protocol, the Redis implementation with registered Lua scripts,
and an in-memory one with the same semantics (tests, single-process embedding)."""

from __future__ import annotations
