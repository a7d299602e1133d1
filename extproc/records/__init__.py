"""Usage records for billing: one per finished request, appended to a Redis Stream
(docs/usage-records.md)."""

from __future__ import annotations

from extproc.records.model import FIELDS, UsageRecord

__all__ = ["FIELDS", "UsageRecord"]
