"""ai-quota: a token-aware RPM/TPM quota gateway for LLM traffic (an Envoy ext_proc service)."""

from __future__ import annotations

__version__ = "0.1.0"
