"""The admin changes as pure functions: what each does to the store's state, what it refuses
and with which domain error, and the gRPC status each error answers with."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import yaml

from extproc.admin import changes
from extproc.admin.changes import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from extproc.admin.rules import FileRules, file_rules_from_text
from extproc.admin.service import status_of
from extproc.admin.state import StoredKey, StoredTenant, StoreState
from extproc.admin.store import Conflict, StoreUnavailable
from extproc.config.version import config_version

pytestmark = pytest.mark.unit

NOW = 1_700_000_000.0
RULES = {
    "models": {"m": {"tokenizer": {"kind": "estimate"}, "max_output_tokens": 1000}},
    "plans": {"basic": {"limits": [{"model": "*", "rpm": 60, "tpm": 100000}]}},
    "tenants": {"acme": {"plan": "basic", "keys": [{"name": "acme-1", "plaintext": "sk-acme"}]}},
}


def file_rules() -> FileRules:
    """The rules file of these tests."""
    return file_rules_from_text(
        yaml.safe_dump(RULES), source="r.yaml", base_dir=Path("."), version_of=config_version
    )


def stored(
    kid: str, tenant: str = "acme", name: str = "k", expires: float | None = None
) -> StoredKey:
    """A store key created ten seconds ago."""
    return StoredKey(kid, name, tenant, changes.digest(kid), NOW - 10, expires)


def test_create_key_needs_a_known_tenant_and_a_free_name() -> None:
    """A key goes to a file or store tenant under a name neither the file nor a working store
    key uses; the input state is left alone."""
    rules = file_rules()
    state = StoreState()
    new, _ = changes.create_key(state, rules, stored("key_1", name="ci"), NOW)
    assert list(new.keys) == ["key_1"] and state.keys == {}
    with pytest.raises(NotFound, match="unknown tenant 'nobody'"):
        changes.create_key(state, rules, stored("key_2", tenant="nobody"), NOW)
    with pytest.raises(AlreadyExists):
        changes.create_key(new, rules, stored("key_3", name="ci"), NOW)
    with pytest.raises(AlreadyExists):
        changes.create_key(state, rules, stored("key_4", name="acme-1"), NOW)
    expired = StoreState(keys={"key_5": stored("key_5", name="old", expires=NOW - 1)})
    again, _ = changes.create_key(expired, rules, stored("key_6", name="old"), NOW)
    assert set(again.keys) == {"key_5", "key_6"}


def test_rotate_key_keeps_the_old_key_for_the_grace_only_once() -> None:
    """Rotation with a grace keeps the old key until then (never past its own end); without
    one the old key goes; a rotated key cannot be rotated again."""
    state = StoreState(keys={"key_1": stored("key_1", name="ci")})
    new, (old, fresh) = changes.rotate_key(
        state, "key_1", new_id="key_2", new_digest=changes.digest("s2"), grace=60, now=NOW
    )
    assert (old.id, fresh.id, fresh.name, fresh.tenant) == ("key_1", "key_2", "ci", "acme")
    assert new.keys["key_1"].expires_at == NOW + 60
    with pytest.raises(FailedPrecondition, match="already rotated"):
        changes.rotate_key(new, "key_1", new_id="key_3", new_digest="d", grace=0, now=NOW)
    gone, _ = changes.rotate_key(state, "key_1", new_id="key_3", new_digest="d", grace=0, now=NOW)
    assert set(gone.keys) == {"key_3"}
    with pytest.raises(NotFound):
        changes.rotate_key(state, "key_x", new_id="key_4", new_digest="d", grace=0, now=NOW)
    with pytest.raises(InvalidArgument, match="grace_seconds"):
        changes.check_grace(changes.MAX_GRACE_S + 1)


def level_rules() -> FileRules:
    """The rules above with organisations o1 (teams a, b) and o2 (team c); acme in o1."""
    doc = {
        **RULES,
        "organisations": {"o1": {}, "o2": {}},
        "teams": {
            "a": {"organisation": "o1"},
            "b": {"organisation": "o1"},
            "c": {"organisation": "o2"},
        },
        "tenants": {
            "acme": {
                "plan": "basic",
                "organisation": "o1",
                "keys": [{"name": "acme-1", "plaintext": "sk-acme"}],
            }
        },
    }
    return file_rules_from_text(
        yaml.safe_dump(doc), source="r.yaml", base_dir=Path("."), version_of=config_version
    )


def test_set_key_team_moves_a_store_key_and_its_rotated_predecessor() -> None:
    """A key moves to another team of its tenant's organisation, with the rotated secret still
    in its grace (one key, one team); "" puts it back in its tenant's team; a team of another
    organisation, an unknown team, a rotated key's old id and an unknown id are refused; a
    rotation keeps the key's team."""
    rules = level_rules()
    key = replace(stored("key_1", name="ci"), team="a")
    state, _ = changes.create_key(StoreState(), rules, key, NOW)
    state, (old, new) = changes.rotate_key(
        state, "key_1", new_id="key_2", new_digest=changes.digest("s2"), grace=60, now=NOW
    )
    assert new.team == "a"  # a rotation keeps the key's team
    moved, got = changes.set_key_team(state, rules, "key_2", "b", NOW)
    assert got.id == "key_2" and got.team == "b"
    assert {k.id: k.team for k in moved.keys.values()} == {"key_1": "b", "key_2": "b"}
    assert {k.team for k in state.keys.values()} == {"a"}  # the input state is left alone
    back, got = changes.set_key_team(moved, rules, "key_2", "", NOW)
    assert got.team == "" and {k.team for k in back.keys.values()} == {""}
    with pytest.raises(InvalidArgument, match="more than one organisation"):
        changes.set_key_team(state, rules, "key_2", "c", NOW)
    with pytest.raises(InvalidArgument, match="unknown team 'zz'"):
        changes.set_key_team(state, rules, "key_2", "zz", NOW)
    with pytest.raises(InvalidArgument, match="team"):
        changes.set_key_team(state, rules, "key_2", "bad name!", NOW)
    with pytest.raises(FailedPrecondition, match="rotated"):
        changes.set_key_team(state, rules, "key_1", "b", NOW)
    with pytest.raises(NotFound):
        changes.set_key_team(state, rules, "acme-1", "b", NOW)  # a file key has no key id
    assert old.id == "key_1"


def test_revoke_and_delete_remove_only_what_the_store_holds() -> None:
    """Revoking removes one key; deleting a tenant removes its entry and keys, and refuses a
    tenant the store holds nothing of (saying when the file defines it)."""
    rules = file_rules()
    tenant = StoredTenant(plan="basic")
    state = StoreState(
        tenants={"new": tenant},
        keys={"key_1": stored("key_1", tenant="new"), "key_2": stored("key_2")},
    )
    revoked, key = changes.revoke_key(state, "key_2")
    assert key.id == "key_2" and set(revoked.keys) == {"key_1"}
    with pytest.raises(NotFound):
        changes.revoke_key(revoked, "key_2")
    deleted, removed = changes.delete_tenant(state, rules, "new")
    assert removed == 1 and deleted.tenants == {} and set(deleted.keys) == {"key_2"}
    with pytest.raises(NotFound, match="defined in the rules file"):
        changes.delete_tenant(revoked, rules, "acme")
    with pytest.raises(NotFound) as err:
        changes.delete_tenant(state, rules, "nobody")
    assert "rules file" not in str(err.value)


def test_new_tenant_is_checked_against_the_rules_file() -> None:
    """A tenant's id, limits and plan are checked before anything is stored."""
    rules = file_rules()
    ok = changes.new_tenant(rules, "new", "basic", [{"model": "m", "rpm": 5}], NOW)
    assert ok.plan == "basic" and len(ok.limits) == 1 and ok.updated_at == NOW
    with pytest.raises(InvalidArgument, match="unknown plan 'gold'"):
        changes.new_tenant(rules, "new", "gold", [], NOW)
    with pytest.raises(InvalidArgument):
        changes.new_tenant(rules, "-bad", "basic", [], NOW)
    with pytest.raises(InvalidArgument):
        changes.new_tenant(rules, "new", "basic", [{"per": "fortnight", "rpm": 1}], NOW)
    state, replaced = changes.set_tenant(StoreState(), "new", ok)
    assert not replaced and changes.set_tenant(state, "new", ok)[1]


def test_tenant_view_shows_where_a_tenant_comes_from() -> None:
    """The view takes the store's plan over the file's, lists the file's keys then the store's
    working keys, and a tenant nobody holds is not found."""
    rules = file_rules()
    state = StoreState(
        tenants={"acme": StoredTenant(plan="basic")},
        keys={"key_1": stored("key_1"), "key_2": stored("key_2", expires=NOW - 1)},
    )
    view = changes.tenant_view(state, rules, "acme", NOW)
    assert (view.plan, view.source) == ("basic", "store+file")
    assert [(k.name, k.source, k.key_id) for k in view.keys] == [
        ("acme-1", "file", ""),
        ("k", "store", "key_1"),
    ]
    assert changes.tenant_view(StoreState(), rules, "acme", NOW).source == "file"
    assert changes.tenant_ids(state, rules) == ["acme"]
    with pytest.raises(NotFound):
        changes.known_tenant(state, rules, "nobody")
    assert changes.changes_count(0) == changes.DEFAULT_CHANGES
    with pytest.raises(InvalidArgument):
        changes.changes_count(changes.MAX_CHANGES + 1)


def test_each_refusal_has_its_grpc_status() -> None:
    """The servicer answers each domain error and store failure with one status code."""
    assert status_of(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_of(AlreadyExists("x")) == grpc.StatusCode.ALREADY_EXISTS
    assert status_of(FailedPrecondition("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(StoreUnavailable("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_of(Conflict("x")) == grpc.StatusCode.ABORTED
    with pytest.raises(TypeError):
        status_of(ValueError("x"))
