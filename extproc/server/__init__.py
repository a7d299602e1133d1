"""The gRPC side: the ext_proc servicer, the per-request processor and the protobuf mapping."""

from __future__ import annotations
