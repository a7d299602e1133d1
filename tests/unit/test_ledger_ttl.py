"""ledger_ttl_seconds: configurable, with a safe minimum that check-config enforces."""

from __future__ import annotations

import pytest

from extproc.config import ConfigError
from extproc.config.load import LEDGER_TTL_FLOOR_S, ledger_ttl_minimum, load_config_text

pytestmark = pytest.mark.unit

RULES = """
version: 1
models:
  m: {tokenizer: {kind: estimate}, max_output_tokens: 100}
plans:
  p: {limits: [{model: "*", per: %s, tpm: 1000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-k}]}
ledger_ttl_seconds: %d
"""


def test_minimum_is_the_longest_window_capped_at_an_hour_never_under_the_floor() -> None:
    assert ledger_ttl_minimum(1) == LEDGER_TTL_FLOOR_S == 300
    assert ledger_ttl_minimum(60) == 300
    assert ledger_ttl_minimum(3600) == 3600
    assert ledger_ttl_minimum(86400) == 3600


def test_a_ttl_at_the_minimum_loads() -> None:
    assert load_config_text(RULES % ("hour", 3600)).ledger_ttl_seconds == 3600
    assert load_config_text(RULES % ("minute", 300)).ledger_ttl_seconds == 300


def test_a_ttl_below_the_longest_window_is_an_error_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"ledger_ttl_seconds: 1800 is below the safe minimum 3600"
    ):
        load_config_text(RULES % ("hour", 1800))


def test_a_ttl_below_the_floor_is_an_error() -> None:
    with pytest.raises(ConfigError, match="ledger_ttl_seconds"):
        load_config_text(RULES % ("minute", 120))
