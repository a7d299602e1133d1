"""The admin changes as pure functions (no gRPC, no I/O): each checks its arguments against the
running rules file and the store's state and returns the new state with what the change did,
or raises an :class:`AdminError` saying why it is refused.  The read side (tenant views) is
here too.  :mod:`extproc.admin.service` maps the calls onto these and the errors onto gRPC
status codes; the store applies a change atomically (and retries it on a conflict).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from extproc.admin.rules import FileRules, effective, tenant_errors
from extproc.admin.state import (
    KEY_NAME,
    TENANT_ID,
    StateError,
    StoredKey,
    StoredTenant,
    StoreState,
    parse_limits,
)
from extproc.config import schema
from extproc.config.load import ConfigError

#: The longest grace a rotated key may keep working for.
MAX_GRACE_S = 30 * 24 * 3600
#: Prefix of the secrets the store issues (recognisable in a leak scanner).
KEY_PREFIX = "sk-aiq-"
#: The most audit entries one ``ListChanges`` answer holds (and the default count).
MAX_CHANGES, DEFAULT_CHANGES = 1000, 100


class AdminError(Exception):
    """A change or query refused; the message says why."""


class InvalidArgument(AdminError):
    """The arguments are malformed or do not fit the rules file."""


class NotFound(AdminError):
    """The tenant or key does not exist."""


class AlreadyExists(AdminError):
    """The key name is taken."""


class FailedPrecondition(AdminError):
    """The thing exists but is in the wrong state for the change."""


def new_secret() -> str:
    """A fresh API key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    """A key id (safe to show and log)."""
    return "key_" + secrets.token_hex(8)


def digest(secret: str) -> str:
    """What is stored of a secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


# -- argument checks ---------------------------------------------------------------------------


def check_id(value: str, what: str) -> None:
    """A tenant id the rules file would accept."""
    if not TENANT_ID.match(value):
        raise InvalidArgument(
            f"{what} {value!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit"
        )


def check_key_name(value: str) -> None:
    """A key name the rules file would accept."""
    if not KEY_NAME.match(value):
        raise InvalidArgument(
            f"key name {value!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit"
        )


def check_grace(grace: float) -> None:
    """A rotated key's grace: none, up to :data:`MAX_GRACE_S`."""
    if not 0 <= grace <= MAX_GRACE_S:
        raise InvalidArgument(f"grace_seconds must be between 0 and {MAX_GRACE_S}")


def changes_count(limit: int) -> int:
    """How many audit entries to list (0 means the default)."""
    count = limit or DEFAULT_CHANGES
    if not 0 < count <= MAX_CHANGES:
        raise InvalidArgument(f"limit: 1 to {MAX_CHANGES}")
    return count


def new_tenant(
    rules: FileRules,
    tid: str,
    plan: str,
    limits: Sequence[Mapping[str, Any]],
    now: float,
    *,
    organisation: str = "",
    team: str = "",
) -> StoredTenant:
    """A tenant's store entry: its id and limits well-formed, its plan one of the file's and
    its limits compiling against the file's models and prices (its organisation and team are
    checked with the levels in force: :func:`set_tenant`)."""
    check_id(tid, "tenant")
    for value, what in ((organisation, "organisation"), (team, "team")):
        if value:
            check_id(value, what)
    try:
        parsed = tuple(parse_limits(list(limits)))
    except StateError as exc:
        raise InvalidArgument(str(exc)) from None
    tenant = StoredTenant(
        plan=plan, limits=parsed, updated_at=now, organisation=organisation, team=team
    )
    errors = tenant_errors(rules, tid, replace(tenant, organisation="", team=""))
    if errors:
        raise InvalidArgument(f"tenant {tid!r}: " + "; ".join(errors))
    return tenant


# -- changes ----------------------------------------------------------------------------------


def key_names(state: StoreState, rules: FileRules, tenant: str, now: float) -> set[str]:
    """The names of a tenant's working keys, the file's and the store's."""
    names = {k.name for k in state.keys.values() if k.tenant == tenant and k.active(now)}
    file_tenant = rules.document.tenants.get(tenant)
    if file_tenant is not None:
        names |= {k.name for k in file_tenant.keys}
    return names


def create_key(
    state: StoreState, rules: FileRules, key: StoredKey, now: float
) -> tuple[StoreState, None]:
    """Add ``key`` to a tenant the file or the store defines, under a name it does not use."""
    if key.tenant not in rules.document.tenants and key.tenant not in state.tenants:
        raise NotFound(f"unknown tenant {key.tenant!r}")
    if key.name in key_names(state, rules, key.tenant, now):
        raise AlreadyExists(
            f"tenant {key.tenant!r} already has a key named {key.name!r} (rotate it instead)"
        )
    out = replace(state, keys={**state.keys, key.id: key})
    if key.team:
        check_merged(rules, out, now)  # the team exists, in the tenant's organisation
    return out, None


def active_key(state: StoreState, key_id: str, now: float) -> StoredKey:
    """A store key that works and was not rotated yet."""
    key = state.keys.get(key_id)
    if key is None or not key.active(now):
        raise NotFound(f"unknown key id {key_id!r}")
    if key.expires_at is not None:
        raise FailedPrecondition(
            f"key {key_id!r} was already rotated (it expires); rotate its successor"
        )
    return key


def rotate_key(
    state: StoreState, key_id: str, *, new_id: str, new_digest: str, grace: float, now: float
) -> tuple[StoreState, tuple[StoredKey, StoredKey]]:
    """A new key (``new_id``, ``new_digest``) under the old one's name and tenant; the old key
    ends now, or after ``grace`` seconds (never later than it would have).  Returns the old
    and the new key."""
    old = active_key(state, key_id, now)
    new = StoredKey(new_id, old.name, old.tenant, new_digest, now, team=old.team)
    keys = {k: v for k, v in state.keys.items() if k != old.id}
    if grace > 0:
        ends = now + grace if old.expires_at is None else min(old.expires_at, now + grace)
        keys[old.id] = replace(old, expires_at=ends)
    keys[new.id] = new
    return replace(state, keys=keys), (old, new)


def set_key_team(
    state: StoreState, rules: FileRules, key_id: str, team: str, now: float
) -> tuple[StoreState, StoredKey]:
    """Move a store key to ``team`` ("": its tenant's), with a rotated predecessor of the same
    name still in its grace (one key's requests count in one team); checked with the levels in
    force (the team exists, in the tenant's organisation).  Returns the moved key."""
    if team:
        check_id(team, "team")
    key = active_key(state, key_id, now)
    keys = dict(state.keys)
    for k in state.keys.values():
        if k.tenant == key.tenant and k.name == key.name and k.active(now):
            keys[k.id] = replace(k, team=team)
    out = replace(state, keys=keys)
    check_merged(rules, out, now)
    return out, keys[key.id]


def revoke_key(state: StoreState, key_id: str) -> tuple[StoreState, StoredKey]:
    """Remove a store key; returns it."""
    key = state.keys.get(key_id)
    if key is None:
        raise NotFound(f"unknown key id {key_id!r}")
    keys = {k: v for k, v in state.keys.items() if k != key.id}
    return replace(state, keys=keys), key


def set_tenant(
    state: StoreState,
    tid: str,
    tenant: StoredTenant,
    rules: FileRules | None = None,
    now: float = 0,
) -> tuple[StoreState, bool]:
    """Store a tenant (from :func:`new_tenant`); whether it replaced one.  A tenant placed in
    an organisation or team (``rules`` given) is checked against the levels in force."""
    out = replace(state, tenants={**state.tenants, tid: tenant})
    if rules is not None and (tenant.organisation or tenant.team):
        check_merged(rules, out, now)
    return out, tid in state.tenants


# -- levels (docs/semantics.md, "Levels") ---------------------------------------------------

LEVEL_KINDS = ("organisation", "team")


def check_merged(rules: FileRules, state: StoreState, now: float) -> None:
    """The rules file with ``state`` merged in compiles (InvalidArgument naming why not)."""
    try:
        effective(rules, state, now)
    except ConfigError as exc:
        lines = [line.split(": ", 1)[-1] for line in str(exc).splitlines()]
        raise InvalidArgument("; ".join(lines)) from None


def new_level(kind: str, name: str, doc: Mapping[str, Any]) -> Any:
    """An organisation or team entry (the rules file's shape) from ``doc``."""
    if kind not in LEVEL_KINDS:
        raise InvalidArgument(f"kind {kind!r}: 'organisation' or 'team'")
    check_id(name, kind)
    model = schema.OrganisationEntry if kind == "organisation" else schema.TeamEntry
    try:
        return model.model_validate_json(json.dumps(dict(doc)))
    except ValueError as exc:
        raise InvalidArgument(f"{kind} {name!r}: {exc}".splitlines()[0]) from None


def set_level(
    state: StoreState, rules: FileRules, kind: str, name: str, *, entry: Any, now: float
) -> tuple[StoreState, bool]:
    """Store an organisation or a team (it replaces the file's of that name); checked with
    every tenant and key in it.  Whether it replaced a stored one."""
    if kind == "organisation":
        out = replace(state, organisations={**state.organisations, name: entry})
        had = name in state.organisations
    else:
        out = replace(state, teams={**state.teams, name: entry})
        had = name in state.teams
    check_merged(rules, out, now)
    return out, had


def delete_level(
    state: StoreState, rules: FileRules, kind: str, name: str, now: float
) -> tuple[StoreState, None]:
    """Remove a stored organisation or team (refused while a team, tenant or key of the store
    or the file is in it: the merged rules would not compile)."""
    if kind == "organisation":
        held = name in state.organisations
        in_file = name in rules.document.organisations
        out = replace(
            state, organisations={k: v for k, v in state.organisations.items() if k != name}
        )
    else:
        held = name in state.teams
        in_file = name in rules.document.teams
        out = replace(state, teams={k: v for k, v in state.teams.items() if k != name})
    if not held:
        raise NotFound(
            f"the store holds no {kind} {name!r}"
            + (" (it is defined in the rules file)" if in_file else "")
        )
    try:
        check_merged(rules, out, now)
    except InvalidArgument as exc:
        raise FailedPrecondition(f"{kind} {name!r} is still in use: {exc}") from None
    return out, None


def delete_tenant(state: StoreState, rules: FileRules, tid: str) -> tuple[StoreState, int]:
    """Remove a tenant's store entry and its store keys; how many keys went."""
    keys = {k: v for k, v in state.keys.items() if v.tenant != tid}
    if tid not in state.tenants and len(keys) == len(state.keys):
        raise NotFound(
            f"the store holds nothing for tenant {tid!r}"
            + (" (it is defined in the rules file)" if tid in rules.document.tenants else "")
        )
    tenants = {k: v for k, v in state.tenants.items() if k != tid}
    return replace(state, tenants=tenants, keys=keys), len(state.keys) - len(keys)


def key_fields(key: StoredKey) -> dict[str, Any]:
    """What the audit log says of a key (never its digest)."""
    return {"tenant": key.tenant, "key": key.name, "key_id": key.id}


def key_team_fields(key: StoredKey) -> dict[str, Any]:
    """What the audit log says of a key moved to a team."""
    return {**key_fields(key), "team": key.team}


# -- views ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyView:
    """One key of a tenant as the admin API shows it (never its digest)."""

    name: str
    source: str
    key_id: str = ""
    created_at: float = 0.0
    expires_at: float = 0.0
    team: str = ""


@dataclass(frozen=True, slots=True)
class TenantView:
    """One tenant as the admin API shows it: where it is defined, its plan, limits and keys."""

    tenant: str
    plan: str
    source: str
    limits: tuple[schema.LimitEntry, ...]
    keys: tuple[KeyView, ...]
    organisation: str = ""
    team: str = ""


def tenant_ids(state: StoreState, rules: FileRules) -> list[str]:
    """Every tenant, the file's and the store's (also one the store only holds keys of)."""
    names = set(rules.document.tenants) | set(state.tenants)
    names |= {k.tenant for k in state.keys.values()}
    return sorted(names)


def known_tenant(state: StoreState, rules: FileRules, tid: str) -> None:
    """The tenant exists in the file or the store (or the store holds keys of it)."""
    known = tid in rules.document.tenants or tid in state.tenants
    if not known and not any(k.tenant == tid for k in state.keys.values()):
        raise NotFound(f"unknown tenant {tid!r}")


def tenant_view(state: StoreState, rules: FileRules, tid: str, now: float) -> TenantView:
    """The tenant as in force: the store's entry over the file's, the file's keys and the
    store's working keys (oldest first)."""
    file_t = rules.document.tenants.get(tid)
    store_t = state.tenants.get(tid)
    source = "store+file" if store_t and file_t else "store" if store_t else "file"
    if store_t is None and file_t is None:
        source = "store"  # keys only, of a tenant neither defines (not in force)
    plan = store_t.plan if store_t else file_t.plan if file_t else ""
    limits = store_t.limits if store_t else tuple(file_t.limits) if file_t else ()
    keys: list[KeyView] = []
    if file_t is not None:
        keys.extend(KeyView(name=fk.name, source="file", team=fk.team or "") for fk in file_t.keys)
    for k in sorted(state.keys.values(), key=lambda k: (k.created_at, k.id)):
        if k.tenant == tid and k.active(now):
            keys.append(
                KeyView(
                    name=k.name,
                    source="store",
                    key_id=k.id,
                    created_at=k.created_at,
                    expires_at=k.expires_at or 0.0,
                    team=k.team,
                )
            )
    org = store_t.organisation if store_t else (file_t.organisation or "") if file_t else ""
    team = store_t.team if store_t else (file_t.team or "") if file_t else ""
    return TenantView(
        tenant=tid,
        plan=plan,
        source=source,
        limits=limits,
        keys=tuple(keys),
        organisation=org,
        team=team,
    )
