"""The admin store merged into the rules file: precedence, skipped entries, key expiry, the
effective version, write-time validation, and the admin API's pure helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc._gen.aiquota.v1 import admin_pb2
from extproc.admin.cli import limit_message
from extproc.admin.convert import limit_to_mapping, limit_to_message
from extproc.admin.rules import FileRules, effective, file_rules_from_text, tenant_errors
from extproc.admin.state import StoredKey, StoredTenant, StoreState, merge, parse_limits
from extproc.config.load import key_digest
from extproc.config.schema import LimitEntry
from extproc.config.version import config_version

pytestmark = pytest.mark.unit

RULES = {
    "models": {
        "m": {
            "aliases": ["m-alias"],
            "tokenizer": {"kind": "estimate"},
            "max_output_tokens": 1000,
        }
    },
    "plans": {
        "basic": {"limits": [{"model": "*", "rpm": 60, "tpm": 100000}]},
        "pro": {"limits": [{"model": "*", "rpm": 600, "tpm": 1000000}]},
    },
    "tenants": {"acme": {"plan": "basic", "keys": [{"name": "acme-1", "plaintext": "sk-acme"}]}},
}
NOW = 1_700_000_000.0


def rules(doc: dict[str, object] | None = None) -> FileRules:
    """The admin view of a rules document."""
    text = yaml.safe_dump(doc or RULES)
    return file_rules_from_text(
        text, source="r.yaml", base_dir=Path("."), version_of=config_version
    )


def key(
    kid: str, tenant: str, secret: str, *, name: str = "k", expires: float | None = None
) -> StoredKey:
    """A stored key created ten seconds ago."""
    return StoredKey(kid, name, tenant, key_digest(secret), NOW - 10, expires)


def limits(*entries: dict[str, object]) -> tuple[LimitEntry, ...]:
    """Limit entries as the admin API validates them."""
    return tuple(parse_limits(list(entries)))


def test_empty_store_is_the_file_alone() -> None:
    """An empty store leaves the file's compiled rules and version untouched."""
    r = rules()
    eff = effective(r, StoreState(), NOW)
    assert eff.config is r.config
    assert eff.version == r.version == config_version(yaml.safe_dump(RULES))


def test_store_tenant_and_key_are_added() -> None:
    """A store tenant and its key are added next to the file's."""
    state = StoreState(
        version=3,
        tenants={"new": StoredTenant("pro")},
        keys={"key_1": key("key_1", "new", "sk-new")},
    )
    eff = effective(rules(), state, NOW)
    cfg = eff.config
    assert cfg.tenants["new"].plan == "pro"
    found = cfg.keys_by_digest[key_digest("sk-new")]
    assert (found.tenant, found.name) == ("new", "k")
    assert key_digest("sk-acme") in cfg.keys_by_digest  # the file's keys still work
    assert eff.store_version == 3 and eff.version != rules().version


def test_store_wins_for_a_tenant_both_define() -> None:
    """The store's plan and limits replace the file's for a tenant both define; its file keys stay."""
    state = StoreState(
        tenants={"acme": StoredTenant("pro", limits({"model": "m", "per": "minute", "rpm": 7}))}
    )
    cfg = effective(rules(), state, NOW).config
    acme = cfg.tenants["acme"]
    assert acme.plan == "pro"
    rpm = {(lim.model, lim.limit) for lim in acme.limits if lim.metric == "rpm"}
    # the store's own limit, over the store's plan (not the file's plan or overrides)
    assert rpm == {("*", 600), ("m", 7)}
    assert key_digest("sk-acme") in cfg.keys_by_digest  # the file's key of acme still works


def test_store_key_of_a_file_tenant_adds_to_its_keys() -> None:
    """A store key of a file tenant adds to its keys; plan and limits stay the file's."""
    state = StoreState(keys={"key_1": key("key_1", "acme", "sk-second", name="acme-2")})
    cfg = effective(rules(), state, NOW).config
    assert cfg.tenants["acme"].plan == "basic"
    assert cfg.keys_by_digest[key_digest("sk-second")].name == "acme-2"
    assert key_digest("sk-acme") in cfg.keys_by_digest


def test_unusable_store_entries_are_skipped_and_reported() -> None:
    """Store entries the file cannot take (plan gone, unknown model, no tenant) are left out and reported."""
    state = StoreState(
        tenants={
            "gone": StoredTenant("removed-plan"),
            "odd": StoredTenant("basic", limits({"model": "nope", "rpm": 1})),
            "keyless": StoredTenant("basic"),
        },
        keys={
            "key_1": key("key_1", "gone", "sk-gone"),
            "key_2": key("key_2", "odd", "sk-odd"),
            "key_3": key("key_3", "nobody", "sk-nobody"),
        },
    )
    merged = merge(rules().document, state, NOW)
    assert set(merged.document.tenants) == {"acme"}
    text = "\n".join(merged.skipped)
    assert "plan 'removed-plan'" in text
    assert "unknown model 'nope'" in text
    assert "tenant 'nobody' is defined nowhere" in text
    cfg = effective(rules(), state, NOW).config
    assert key_digest("sk-gone") not in cfg.keys_by_digest


def test_an_alias_names_a_model_in_store_limits() -> None:
    """A model alias in a store limit resolves to the model."""
    state = StoreState(
        tenants={"t": StoredTenant("basic", limits({"model": "m-alias", "rpm": 3}))},
        keys={"key_1": key("key_1", "t", "sk-t")},
    )
    cfg = effective(rules(), state, NOW).config
    assert any(lim.model == "m" and lim.limit == 3 for lim in cfg.tenants["t"].limits)


def test_expired_keys_are_left_out_and_change_the_version() -> None:
    """A key past its grace is left out and changes the effective version."""
    state = StoreState(
        tenants={"t": StoredTenant("basic")},
        keys={
            "old": key("old", "t", "sk-old", expires=NOW + 5),
            "new": key("new", "t", "sk-new"),
        },
    )
    before = effective(rules(), state, NOW)
    after = effective(rules(), state, NOW + 6)
    assert key_digest("sk-old") in before.config.keys_by_digest
    assert key_digest("sk-old") not in after.config.keys_by_digest
    assert key_digest("sk-new") in after.config.keys_by_digest
    assert before.version != after.version
    assert state.next_expiry(NOW) == NOW + 5
    assert state.next_expiry(NOW + 6) is None


def test_version_is_the_same_for_the_same_rules_and_store() -> None:
    """The effective version depends on the content only, not on store versions or times."""
    a = StoreState(version=1, tenants={"t": StoredTenant("basic", updated_at=1.0)})
    b = StoreState(version=9, tenants={"t": StoredTenant("basic", updated_at=2.0)})
    c = StoreState(version=9, tenants={"t": StoredTenant("pro")})
    r = rules()
    assert effective(r, a, NOW).version == effective(r, b, NOW).version
    assert effective(r, a, NOW).version != effective(r, c, NOW).version


def test_snapshot_round_trip() -> None:
    """A snapshot survives JSON and never holds a secret."""
    state = StoreState(
        version=4,
        tenants={"t": StoredTenant("pro", limits({"per": "month", "budget": 5}), 12.5)},
        keys={"k1": key("k1", "t", "sk-1", expires=NOW + 1)},
    )
    again = StoreState.from_json(state.to_json())
    assert again == state
    assert "sk-1" not in state.to_json()


def test_tenant_errors_at_write_time() -> None:
    """Write-time validation refuses unknown plans, unknown models and unpriced budgets."""
    r = rules()
    assert tenant_errors(r, "t", StoredTenant("basic")) == []
    assert tenant_errors(r, "acme", StoredTenant("pro", limits({"rpm": 5}))) == []
    unknown = tenant_errors(r, "t", StoredTenant("gold"))
    assert unknown and "unknown plan 'gold'" in unknown[0]
    bad_model = tenant_errors(r, "t", StoredTenant("basic", limits({"model": "x", "rpm": 1})))
    assert bad_model and "unknown model 'x'" in bad_model[0]
    unpriced = tenant_errors(r, "t", StoredTenant("basic", limits({"per": "day", "budget": 1})))
    assert unpriced and "no pricing" in unpriced[0]


def test_limit_messages_round_trip() -> None:
    """Limit messages and rules-file entries convert both ways with presence kept."""
    entry = {
        "model": "m",
        "per": "hour",
        "tpm": 500,
        "weighted_tokens": 9,
        "weights": {"input": 1, "output": 4},
        "shadow": True,
    }
    msg = limit_message(entry)
    (parsed,) = parse_limits([limit_to_mapping(msg)])
    assert parsed.tpm == 500 and parsed.rpm is None and parsed.shadow
    assert parsed.weights is not None and parsed.weights.output == 4
    back = limit_to_message(parsed, admin_pb2.Limit)
    assert limit_to_mapping(back)["per"] == "hour" and not back.HasField("rpm")
