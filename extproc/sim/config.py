"""Configuration of the upstream simulator: a frozen dataclass, optionally loaded from YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TEXT_MODES: tuple[str, ...] = ("mixed", "english", "chinese", "fixed")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Static settings of one simulator process; request headers may override some per request."""

    host: str = "127.0.0.1"
    port: int = 18080
    models: tuple[str, ...] = ("sim-small",)
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    tokens_per_chunk: int = 1
    default_tokens: int = 256
    max_tokens_cap: int = 4096
    seed: int = 0
    text_mode: str = "mixed"
    max_records: int = 10000
    context_tokens: int = 8192
    #: listen with SO_REUSEPORT: several simulator processes share one port (the kernel
    #: spreads connections; each keeps its own records)
    reuse_port: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must name at least one model id")
        if self.text_mode not in TEXT_MODES:
            modes = ", ".join(TEXT_MODES)
            raise ValueError(f"text_mode must be one of {modes}, got {self.text_mode!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.ttft_ms < 0 or self.itl_ms < 0:
            raise ValueError("ttft_ms and itl_ms must be >= 0")
        if self.tokens_per_chunk < 1:
            raise ValueError("tokens_per_chunk must be >= 1")
        if self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be >= 1")
        if not 0 <= self.default_tokens <= self.max_tokens_cap:
            raise ValueError("default_tokens must be between 0 and max_tokens_cap")
        if self.context_tokens < 1:
            raise ValueError("context_tokens must be >= 1")
        if self.max_records < 1:
            raise ValueError("max_records must be >= 1")

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> SimConfig:
        """Build a config from a plain mapping; unknown keys raise ``ValueError`` naming the key."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown simulator config key: {key!r}")
            if name == "models":
                if isinstance(value, str):
                    kwargs[name] = (value,)
                elif isinstance(value, list | tuple):
                    kwargs[name] = tuple(str(v) for v in value)
                else:
                    raise ValueError("models must be a string or a list of strings")
            else:
                kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SimConfig:
        """Load a config from a YAML mapping (keys are the field names); unknown keys are errors."""
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: simulator config must be a YAML mapping")
        return cls.from_mapping(raw)
