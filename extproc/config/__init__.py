"""Configuration: a strict YAML schema compiled into a frozen runtime form."""

from __future__ import annotations

from extproc.config.load import ConfigError, load_config, load_config_text
from extproc.config.runtime import RuntimeConfig

__all__ = ["ConfigError", "RuntimeConfig", "load_config", "load_config_text"]
