"""The limiter boundary: one protocol, one Redis implementation with registered Lua scripts."""

from __future__ import annotations
