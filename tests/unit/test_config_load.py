"""Unit tests for loading, validating and compiling rules files (extproc.config.load)."""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ConfigError, load_config, load_config_text
from extproc.config.load import key_digest
from extproc.config.runtime import ApiKey, RuntimeConfig
from extproc.config.source import render_path
from extproc.core.rules import Charging, Limit

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "config" / "demo.yaml"
DATA = ROOT / "tests" / "data" / "config"

BASE: dict[str, Any] = {
    "models": {
        "sim-small": {
            "aliases": ["sim"],
            "tokenizer": {"kind": "estimate"},
            "max_output_tokens": 1024,
        }
    },
    "plans": {"basic": {"limits": [{"model": "*", "rpm": 60, "tpm": 100000}]}},
    "tenants": {"acme": {"plan": "basic", "keys": [{"name": "acme-1", "plaintext": "sk-acme"}]}},
}


def doc(edit: Any = None) -> str:
    """The BASE document as YAML, after ``edit(d)`` mutated a deep copy of it."""
    d = copy.deepcopy(BASE)
    if edit is not None:
        edit(d)
    return yaml.safe_dump(d)


def error_of(text: str, source: str = "rules.yaml") -> str:
    """The ConfigError message loading ``text`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source=source)
    return str(info.value)


def fixture_error(name: str) -> str:
    """The ConfigError message loading the fixture file ``name`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(DATA / name)
    return str(info.value)


# -- the demo and valid files --------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> RuntimeConfig:
    """The demo rules file, compiled."""
    return load_config(DEMO)


def test_demo_loads_its_tenants(demo: RuntimeConfig) -> None:
    """The demo config has its four tenants on their plans; the budget plan is priced."""
    assert {t: demo.tenants[t].plan for t in demo.tenants} == {
        "demo-standard": "standard",
        "demo-tight": "tight",
        "demo-strict": "tight-strict",
        "demo-budget": "budget",
    }
    metrics = {lim.metric for lim in demo.tenants["demo-budget"].limits}
    assert metrics == {"rpm", "cost", "concurrency", "tpm"}
    assert demo.models["sim-small"].prices is not None
    assert demo.source == str(DEMO)
    assert demo.plaintext_keys == 0


def test_demo_alias_resolves(demo: RuntimeConfig) -> None:
    """The alias 'sim' and the name 'sim-small' resolve to the same model; others do not."""
    sim = demo.resolve_model("sim")
    assert sim is not None
    assert sim.name == "sim-small"
    assert sim.max_output_tokens == 1024
    assert demo.resolve_model("sim-small") is sim
    assert demo.resolve_model("gpt-4o") is None
    assert demo.aliases == {"sim": "sim-small"}


def test_demo_keys_by_digest(demo: RuntimeConfig) -> None:
    """Demo keys are found by the sha256 of the presented key."""
    key = demo.keys_by_digest[key_digest("sk-demo-tight")]
    assert key == ApiKey(name="demo-tight-1", tenant="demo-tight")
    assert key_digest("sk-demo-tight") == hashlib.sha256(b"sk-demo-tight").hexdigest()
    assert len(demo.keys_by_digest) == 4


def test_demo_limits_and_policies(demo: RuntimeConfig) -> None:
    """Demo plan limits compile into per-minute RPM/TPM limits and the policies are read."""
    assert demo.tenants["demo-tight"].limits == (
        Limit("rpm", 5, 60, "*", "tenant"),
        Limit("tpm", 2000, 60, "*", "tenant"),
    )
    assert demo.unknown_model_action == "reject"
    assert demo.unknown_model_status == 404
    assert demo.unknown_model.known is False
    assert demo.max_n == 16
    assert demo.max_tokens_ceiling == 1_000_000
    assert demo.failure_mode == "closed"
    assert demo.redis_timeout_ms == 250


def test_demo_charging(demo: RuntimeConfig) -> None:
    """The strict plan streams strictly; the tight plan lowers N; the rest inherit the defaults."""
    assert demo.charging_for("tight-strict", "sim-small") == Charging(
        "stream_incremental", "strict", 64
    )
    assert demo.charging_for("tight", "sim-small") == Charging("stream_incremental", "lazy", 32)
    assert demo.charging_for("standard", "sim-small") == Charging("stream_incremental", "lazy", 64)


def test_minimal_fixture_defaults() -> None:
    """A minimal file gets the documented defaults for everything it omits."""
    cfg = load_config(DATA / "minimal.yaml")
    assert cfg.charging_for("basic", "sim-small") == Charging()
    assert "/v1/chat/completions" in cfg.metered_paths
    assert cfg.other_paths == "reject"
    assert "/v1/models" in cfg.allowed_paths
    assert cfg.max_body_bytes == 1_048_576
    assert cfg.over_model_cap == "clamp"
    assert cfg.force_include_usage is True
    assert cfg.count_refused_requests is False
    assert cfg.ledger_ttl_seconds == 3600
    assert cfg.plaintext_keys == 1


def test_load_config_text_defaults_source() -> None:
    """Without a source the errors name '<string>'."""
    with pytest.raises(ConfigError, match=r"^<string>: "):
        load_config_text("[1]")


# -- unknown keys --------------------------------------------------------------------------


def test_unknown_key_fixture_names_source_and_path() -> None:
    """A typo'd key is rejected with the file name and the dotted path."""
    msg = fixture_error("unknown_key.yaml")
    assert f"{DATA / 'unknown_key.yaml'}:4:5: models.sim-small.tokenizr: unknown key" in msg


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        node: Any = d
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    "path",
    [
        ("colour",),
        ("models", "sim-small", "tokenizr"),
        ("models", "sim-small", "tokenizer", "encodng"),
        ("models", "sim-small", "charging", "every"),
        ("plans", "basic", "limits", 0, "rmp"),
        ("plans", "basic", "discount"),
        ("tenants", "acme", "keys", 0, "sha"),
        ("tenants", "acme", "owner"),
        ("charging", "modee"),
        ("unknown_models", "actoin"),
        ("unknown_models", "tokenizer", "chars"),
        ("paths", "others"),
        ("requests", "max_body"),
        ("failure", "timeout"),
    ],
)
def test_unknown_key_anywhere_rejected(path: tuple[Any, ...]) -> None:
    """An unknown key at any depth is rejected, naming source and dotted path."""
    dotted = render_path(path)
    msg = error_of(doc(_set(path, 1)), source="my.yaml")
    assert re.fullmatch(rf"my\.yaml:\d+:\d+: {re.escape(dotted)}: unknown key", msg), msg


def test_all_errors_reported_together() -> None:
    """Several schema errors are all listed, one per line."""

    def edit(d: dict[str, Any]) -> None:
        d["models"]["sim-small"]["tokenizr"] = 1
        d["tenants"]["acme"]["owner"] = 2

    lines = [line.split(": ", 1)[1] for line in error_of(doc(edit)).splitlines()]
    assert "models.sim-small.tokenizr: unknown key" in lines
    assert "tenants.acme.owner: unknown key" in lines


# -- wrong types and values ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (
            ("models", "sim-small", "max_output_tokens"),
            "lots",
            "models.sim-small.max_output_tokens",
        ),
        (("models", "sim-small", "max_output_tokens"), 0, "models.sim-small.max_output_tokens"),
        (("models", "sim-small", "aliases"), "sim", "models.sim-small.aliases"),
        (
            ("models", "sim-small", "tokenizer", "kind"),
            "sentencepiece",
            "models.sim-small.tokenizer.kind",
        ),
        (
            ("models", "sim-small", "tokenizer", "chars_per_token"),
            0,
            "models.sim-small.tokenizer.chars_per_token",
        ),
        (("plans", "basic", "limits", 0, "rpm"), -1, "plans.basic.limits[0].rpm"),
        (("plans", "basic", "limits", 0, "rpm"), 1.5, "plans.basic.limits[0].rpm"),
        (("plans", "basic", "limits", 0, "per"), "fortnight", "plans.basic.limits[0].per"),
        (("plans", "basic", "limits", 0, "scope"), "org", "plans.basic.limits[0].scope"),
        (("plans", "basic", "limits"), {"rpm": 1}, "plans.basic.limits"),
        (("tenants", "acme", "keys"), [], "tenants.acme.keys"),
        (("tenants", "acme", "plan"), None, "tenants.acme.plan"),
        (("charging", "mode"), "reserve_everything", "charging.mode"),
        (("charging", "charge_every_tokens"), 0, "charging.charge_every_tokens"),
        (("unknown_models", "status"), 500, "unknown_models.status"),
        (("requests", "max_n"), 0, "requests.max_n"),
        (("failure", "mode"), "sideways", "failure.mode"),
        (("version",), 2, "version"),
        (("plans",), [], "plans"),
        (("tenants",), {}, "tenants"),
    ],
)
def test_wrong_type_or_value_rejected(path: tuple[Any, ...], value: Any, where: str) -> None:
    """A wrong type or out-of-range value is rejected naming its dotted path."""
    msg = error_of(doc(_set(path, value)))
    assert re.search(rf"^rules\.yaml(:\d+:\d+)?: {re.escape(where)}: ", msg, re.M), msg


def test_limit_without_rpm_or_tpm_rejected() -> None:
    """A limit entry with neither rpm nor tpm is rejected."""
    msg = error_of(doc(_set(("plans", "basic", "limits"), [{"model": "*"}])))
    assert "plans.basic.limits[0]" in msg
    assert "at least one of 'rpm', 'tpm', 'budget'" in msg


def test_boolean_limit_rejected() -> None:
    """``rpm: true`` is a wrong type, not a limit of 1."""
    msg = error_of(doc(_set(("plans", "basic", "limits", 0, "rpm"), True)))
    assert "plans.basic.limits[0].rpm" in msg


# -- names and references ------------------------------------------------------------------


def test_unknown_plan_fixture() -> None:
    """A tenant on an unknown plan is rejected naming the tenant's plan field."""
    msg = fixture_error("unknown_plan.yaml")
    assert "tenants.acme.plan: unknown plan 'premium'" in msg
    assert str(DATA / "unknown_plan.yaml") in msg


def test_unknown_model_in_tenant_limit_fixture() -> None:
    """A tenant limit for an unknown model is rejected with the list index."""
    msg = fixture_error("unknown_model_limit.yaml")
    assert "tenants.acme.limits[1].model: unknown model 'gpt-9'" in msg


def test_unknown_model_in_unused_plan_limit() -> None:
    """A plan limit for an unknown model is rejected even when no tenant uses the plan."""

    def edit(d: dict[str, Any]) -> None:
        d["plans"]["spare"] = {"limits": [{"model": "gpt-9", "rpm": 1}]}

    assert "plans.spare.limits[0].model: unknown model 'gpt-9'" in error_of(doc(edit))


def test_unknown_model_in_used_plan_limit_fixture() -> None:
    """A plan limit for an unknown model, on a plan a tenant uses, is a ConfigError."""
    msg = fixture_error("plan_unknown_model_limit.yaml")
    assert "plans.basic.limits[0].model: unknown model 'gpt-9'" in msg


def test_limit_may_name_alias() -> None:
    """A limit naming an alias applies to the canonical model."""
    cfg = load_config_text(doc(_set(("plans", "basic", "limits"), [{"model": "sim", "rpm": 3}])))
    assert cfg.tenants["acme"].limits == (Limit("rpm", 3, 60, "sim-small", "tenant"),)


@pytest.mark.parametrize("kind", ["models", "plans", "tenants"])
def test_bad_names_rejected(kind: str) -> None:
    """Model, plan and tenant names must be identifiers."""

    def edit(d: dict[str, Any]) -> None:
        section = d[kind]
        name = next(iter(section))
        section["bad name!"] = section.pop(name)
        if kind == "plans":
            d["tenants"]["acme"]["plan"] = "bad name!"

    assert f"{kind}.bad name!: names may use letters" in error_of(doc(edit))


def test_alias_clash_with_model_rejected() -> None:
    """An alias equal to another model's name is rejected."""

    def edit(d: dict[str, Any]) -> None:
        d["models"]["other"] = {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 5}
        d["models"]["sim-small"]["aliases"] = ["other"]

    assert "models.sim-small.aliases: 'other' is already a model or alias" in error_of(doc(edit))


# -- keys ----------------------------------------------------------------------------------


def test_duplicate_key_digest_fixture() -> None:
    """The same key under two tenants (plaintext and digest) is rejected."""
    msg = fixture_error("duplicate_key.yaml")
    assert "tenants.globex.keys[0]: this key is already assigned" in msg


@pytest.mark.parametrize(
    "key",
    [
        {"name": "k"},
        {"name": "k", "plaintext": "x", "sha256": "a" * 64},
    ],
)
def test_key_needs_exactly_one_secret(key: dict[str, str]) -> None:
    """A key with both or neither of sha256 and plaintext is rejected."""
    msg = error_of(doc(_set(("tenants", "acme", "keys"), [key])))
    assert "tenants.acme.keys[0]" in msg
    assert "exactly one of 'sha256' or 'plaintext'" in msg


@pytest.mark.parametrize("digest", ["A" * 64, "a" * 63, "a" * 65, "g" * 64, ""])
def test_bad_sha256_hex_rejected(digest: str) -> None:
    """A sha256 that is not 64 lower-case hex characters is rejected."""
    msg = error_of(doc(_set(("tenants", "acme", "keys"), [{"name": "k", "sha256": digest}])))
    assert "tenants.acme.keys[0].sha256" in msg
    assert "64 lower-case hex" in msg


def test_bad_key_name_rejected() -> None:
    """Key names follow the identifier pattern."""
    msg = error_of(doc(_set(("tenants", "acme", "keys"), [{"name": "a b", "plaintext": "x"}])))
    assert "tenants.acme.keys[0].name" in msg


def test_plaintext_keys_counted_and_hashed() -> None:
    """Plaintext keys are counted and registered under their sha256."""

    def edit(d: dict[str, Any]) -> None:
        d["tenants"]["acme"]["keys"] = [
            {"name": "a1", "plaintext": "one"},
            {"name": "a2", "plaintext": "two"},
            {"name": "a3", "sha256": "b" * 64},
        ]

    cfg = load_config_text(doc(edit))
    assert cfg.plaintext_keys == 2
    assert cfg.keys_by_digest[key_digest("two")] == ApiKey("a2", "acme")
    assert cfg.keys_by_digest["b" * 64] == ApiKey("a3", "acme")
    assert "two" not in repr(cfg)


# -- tokenizers ----------------------------------------------------------------------------


def test_tiktoken_without_encoding_fixture() -> None:
    """A tiktoken tokenizer without an encoding is rejected at its path."""
    msg = fixture_error("tiktoken_no_encoding.yaml")
    assert "models.sim-small.tokenizer: " in msg
    assert "needs 'encoding'" in msg


def test_huggingface_without_path_rejected() -> None:
    """A huggingface tokenizer without a path is rejected."""
    msg = error_of(doc(_set(("models", "sim-small", "tokenizer"), {"kind": "huggingface"})))
    assert "models.sim-small.tokenizer: " in msg
    assert "needs 'path'" in msg


def test_huggingface_missing_file_names_path() -> None:
    """A tokenizer.json that does not exist is a ConfigError naming the resolved path."""
    msg = fixture_error("huggingface_missing.yaml")
    assert str(DATA / "no-such-dir" / "tokenizer.json") in msg
    assert "not found" in msg
    assert msg.startswith(f"{DATA / 'huggingface_missing.yaml'}:2:1: models: ")


def test_unknown_tiktoken_encoding_rejected() -> None:
    """An encoding tiktoken does not know is a ConfigError naming it."""
    msg = error_of(
        doc(_set(("models", "sim-small", "tokenizer"), {"kind": "tiktoken", "encoding": "cl99k"}))
    )
    assert "unknown tiktoken encoding 'cl99k'" in msg


def test_unknown_models_tokenizer_loaded() -> None:
    """The fallback tokenizer for unknown models is compiled into unknown_model."""
    cfg = load_config_text(
        doc(_set(("unknown_models",), {"action": "estimate", "max_output_tokens": 77}))
    )
    assert cfg.unknown_model_action == "estimate"
    assert cfg.unknown_model.max_output_tokens == 77
    assert cfg.unknown_model.tokenizer.kind == "estimate"
    assert cfg.unknown_model.counter.count("x" * 30) > 0


def test_infinite_chars_per_token_is_config_error() -> None:
    """An infinite chars_per_token is reported as a ConfigError."""
    text = doc(_set(("models", "sim-small", "tokenizer", "chars_per_token"), float("inf")))
    assert "chars_per_token" in error_of(text)


# -- unreadable / unparsable files ---------------------------------------------------------


def test_invalid_yaml_fixture() -> None:
    """Invalid YAML is a ConfigError naming the file."""
    msg = fixture_error("invalid_yaml.yaml")
    assert msg.startswith(f"{DATA / 'invalid_yaml.yaml'}:4:6: not valid YAML")


@pytest.mark.parametrize("text", ["", "just a string", "42", "- a\n- b\n"])
def test_non_mapping_top_level(text: str) -> None:
    """A document whose top level is not a mapping is rejected."""
    assert error_of(text) == "rules.yaml: the top level must be a mapping"


def test_top_level_list_fixture() -> None:
    """The list fixture is rejected as a non-mapping top level."""
    assert fixture_error("top_level_list.yaml").endswith("the top level must be a mapping")


def test_missing_file(tmp_path: Path) -> None:
    """A file that does not exist is a ConfigError naming it."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: cannot read config")


def test_directory_is_unreadable(tmp_path: Path) -> None:
    """A directory instead of a file is a ConfigError, not an OSError."""
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path)


def test_non_utf8_file(tmp_path: Path) -> None:
    """A file that is not UTF-8 is a ConfigError."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"models: {caf\xe9: 1}\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml"):
        load_config(path)


# -- limit merging -------------------------------------------------------------------------


def test_tenant_limits_override_plan_limits() -> None:
    """Tenant limits replace plan limits with the same (metric, model, scope, window) only."""
    cfg = load_config(DATA / "overrides.yaml")
    plain = set(cfg.tenants["plain"].limits)
    special = set(cfg.tenants["special"].limits)
    assert plain == {
        Limit("rpm", 60, 60, "*", "tenant"),
        Limit("tpm", 100000, 60, "*", "tenant"),
        Limit("tpm", 1000000, 86400, "*", "tenant"),
        Limit("rpm", 5, 60, "big", "tenant"),
        Limit("rpm", 30, 60, "*", "key"),
    }
    assert special == {
        Limit("rpm", 60, 60, "*", "tenant"),  # kept: only the minute TPM was overridden
        Limit("tpm", 500, 60, "*", "tenant"),  # overridden
        Limit("tpm", 1000000, 86400, "*", "tenant"),  # other window kept
        Limit("rpm", 5, 60, "big", "tenant"),  # other model kept
        Limit("rpm", 3, 60, "*", "key"),  # key scope overridden
        Limit("rpm", 2, 60, "sim-small", "tenant"),  # alias resolved, added
        Limit("rpm", 100, 3600, "*", "tenant"),  # new window added
    }
    assert len(cfg.tenants["special"].limits) == 7


# -- charging resolution -------------------------------------------------------------------


@pytest.fixture(scope="module")
def charging_cfg() -> RuntimeConfig:
    """The charging fixture, compiled."""
    return load_config(DATA / "charging.yaml")


@pytest.mark.parametrize(
    ("plan", "model", "expected"),
    [
        ("strict-plan", "tuned", Charging("reserve_refund", "strict", 16)),
        ("strict-plan", "plain", Charging("reserve_max", "strict", 32)),
        ("cheap-plan", "tuned", Charging("input_only", "lazy", 16)),
        ("cheap-plan", "plain", Charging("input_only", "lazy", 32)),
        ("default-plan", "tuned", Charging("reserve_refund", "lazy", 16)),
        ("default-plan", "plain", Charging("reserve_max", "lazy", 32)),
        ("cheap-plan", "not-configured", Charging("input_only", "lazy", 32)),
        ("default-plan", "not-configured", Charging("reserve_max", "lazy", 32)),
    ],
)
def test_charging_for_resolution_order(
    charging_cfg: RuntimeConfig, plan: str, model: str, expected: Charging
) -> None:
    """charging_for resolves plan over model over the file's defaults."""
    assert charging_cfg.charging_for(plan, model) == expected
