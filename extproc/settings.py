"""Process settings from the environment (``AIQ_*``), read once at start-up, never at import."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Settings:
    """How this process runs (the rules live in the YAML file named by ``config``)."""

    config: str = "config/demo.yaml"
    redis_url: str = "redis://127.0.0.1:6379/0"
    grpc_address: str = "127.0.0.1:50051"
    key_prefix: str = "aiq"
    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"
    metrics_port: int = 0
    usage_address: str = ""
    workers: int = 1
    reuse_port: bool = False
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    shutdown_grace_s: float = 10.0
    # SIGTERM: seconds the health service reports NOT_SERVING while still serving every stream,
    # so Envoy's active health check moves new requests away before the listener closes.
    drain_notice_s: float = 1.5

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``AIQ_CONFIG``, ``AIQ_REDIS_URL``, ``AIQ_GRPC_ADDRESS``, ``AIQ_KEY_PREFIX``,
        ``AIQ_LOG_FORMAT``, ``AIQ_LOG_LEVEL``, ``AIQ_METRICS_PORT``, ``AIQ_WORKERS``,
        ``AIQ_REUSEPORT``, ``AIQ_EVENT_LOOP`` (uvloop|asyncio), ``AIQ_SHUTDOWN_GRACE_S``,
        ``AIQ_DRAIN_NOTICE_S``; explicit ``overrides`` (from CLI flags) win."""
        e = os.environ if env is None else env
        base = cls()
        fmt = e.get("AIQ_LOG_FORMAT", base.log_format)
        values: dict[str, object] = {
            "config": e.get("AIQ_CONFIG", base.config),
            "redis_url": e.get("AIQ_REDIS_URL", base.redis_url),
            "grpc_address": e.get("AIQ_GRPC_ADDRESS", base.grpc_address),
            "key_prefix": e.get("AIQ_KEY_PREFIX", base.key_prefix),
            "log_format": "console" if fmt == "console" else "json",
            "log_level": e.get("AIQ_LOG_LEVEL", base.log_level),
            "metrics_port": int(e.get("AIQ_METRICS_PORT", base.metrics_port)),
            "workers": int(e.get("AIQ_WORKERS", base.workers)),
            "reuse_port": e.get("AIQ_REUSEPORT", "0") == "1",
            "event_loop": "asyncio" if e.get("AIQ_EVENT_LOOP") == "asyncio" else "uvloop",
            "shutdown_grace_s": float(e.get("AIQ_SHUTDOWN_GRACE_S", base.shutdown_grace_s)),
            "drain_notice_s": float(e.get("AIQ_DRAIN_NOTICE_S", base.drain_notice_s)),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
