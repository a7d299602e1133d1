"""The usage API (protos/aiquota/v1/usage.proto): where a tenant stands, and its CLI."""

from __future__ import annotations
