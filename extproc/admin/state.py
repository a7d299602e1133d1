"""What the admin store holds, and how it is merged with the rules file (no IO here).

The store's state is one JSON document (a snapshot), replaced as a whole by every change:

* ``tenants``: tenant id -> its plan and limit overrides (:class:`StoredTenant`);
* ``keys``: key id -> name, tenant, SHA-256 digest of the secret, creation time and an
  optional expiry (:class:`StoredKey`); a revoked key is removed;
* ``organisations`` and ``teams``: levels (docs/semantics.md, "Levels") in the rules file's
  shape; a store level replaces the file's level of the same name.

Precedence (docs/admin.md, "Precedence"): the rules file names the models, plans and every
policy; the store adds tenants and keys.  For a tenant the store defines, the store's plan and
limits replace the file's (the file's keys of that tenant still work: the file is their
source).  A store key of a tenant only the file defines adds to the file's keys.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from extproc.config import schema

#: Names of tenants and keys (the rules file's rules).
TENANT_ID = schema.IDENT
KEY_NAME = schema.IDENT


class StateError(ValueError):
    """A stored document (or a change to it) that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class StoredKey:
    """An API key the store issued; only the digest of its secret is kept."""

    id: str
    name: str
    tenant: str
    sha256: str
    created_at: float
    expires_at: float | None = None  # a rotated key's grace; None: until revoked
    team: str = ""  # the key's team ("": its tenant's)

    def active(self, now: float) -> bool:
        """Whether the key still authenticates at ``now`` (unix seconds)."""
        return self.expires_at is None or now < self.expires_at

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        out: dict[str, Any] = {
            "name": self.name,
            "tenant": self.tenant,
            "sha256": self.sha256,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }
        if self.team:
            out["team"] = self.team
        return out


@dataclass(frozen=True, slots=True)
class StoredTenant:
    """A tenant the store defines: its plan and limit overrides (rules-file shape)."""

    plan: str
    limits: tuple[schema.LimitEntry, ...] = ()
    updated_at: float = 0.0
    organisation: str = ""  # docs/semantics.md, "Levels"
    team: str = ""

    def to_json(self) -> dict[str, Any]:
        """The stored form (limits as the rules file would write them; levels when set)."""
        out: dict[str, Any] = {
            "plan": self.plan,
            "limits": [lim.model_dump(mode="json", exclude_defaults=True) for lim in self.limits],
            "updated_at": self.updated_at,
        }
        if self.organisation:
            out["organisation"] = self.organisation
        if self.team:
            out["team"] = self.team
        return out


@dataclass(frozen=True, slots=True)
class StoreState:
    """One version of the store."""

    version: int = 0
    tenants: dict[str, StoredTenant] = field(default_factory=dict)
    keys: dict[str, StoredKey] = field(default_factory=dict)
    organisations: dict[str, schema.OrganisationEntry] = field(default_factory=dict)
    teams: dict[str, schema.TeamEntry] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Nothing stored: the rules file alone applies."""
        return not self.tenants and not self.keys and not self.organisations and not self.teams

    def _levels_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.organisations:
            out["organisations"] = {
                n: o.model_dump(mode="json", exclude_defaults=True)
                for n, o in self.organisations.items()
            }
        if self.teams:
            out["teams"] = {
                n: t.model_dump(mode="json", exclude_defaults=True) for n, t in self.teams.items()
            }
        return out

    def to_json(self) -> str:
        """The snapshot document (canonical: sorted keys)."""
        doc = {
            "version": self.version,
            "tenants": {tid: t.to_json() for tid, t in self.tenants.items()},
            "keys": {kid: k.to_json() for kid, k in self.keys.items()},
            **self._levels_json(),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StoreState:
        """Parse a snapshot; :class:`StateError` when it is not one."""
        try:
            doc = json.loads(text)
            tenants = {
                tid: StoredTenant(
                    plan=str(t["plan"]),
                    limits=tuple(parse_limits(t.get("limits", []))),
                    updated_at=float(t.get("updated_at", 0.0)),
                    organisation=str(t.get("organisation", "")),
                    team=str(t.get("team", "")),
                )
                for tid, t in doc.get("tenants", {}).items()
            }
            keys = {
                kid: StoredKey(
                    id=kid,
                    name=str(k["name"]),
                    tenant=str(k["tenant"]),
                    sha256=str(k["sha256"]),
                    created_at=float(k.get("created_at", 0.0)),
                    expires_at=None if k.get("expires_at") is None else float(k["expires_at"]),
                    team=str(k.get("team", "")),
                )
                for kid, k in doc.get("keys", {}).items()
            }
            orgs = {
                n: schema.OrganisationEntry.model_validate_json(json.dumps(o))
                for n, o in doc.get("organisations", {}).items()
            }
            teams = {
                n: schema.TeamEntry.model_validate_json(json.dumps(t))
                for n, t in doc.get("teams", {}).items()
            }
            return cls(
                version=int(doc["version"]),
                tenants=tenants,
                keys=keys,
                organisations=orgs,
                teams=teams,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(f"not an admin store snapshot: {exc}") from exc

    def active_keys(self, now: float) -> list[StoredKey]:
        """Keys that authenticate at ``now``, in a stable order."""
        return sorted(
            (k for k in self.keys.values() if k.active(now)), key=lambda k: (k.tenant, k.id)
        )

    def next_expiry(self, now: float) -> float | None:
        """When the next key still active at ``now`` expires (None: none will)."""
        ends = [k.expires_at for k in self.keys.values() if k.expires_at and k.expires_at > now]
        return min(ends) if ends else None

    def fingerprint(self, now: float) -> str:
        """A hash of what the store contributes to the rules at ``now`` (tenants, and the
        keys active then: an expired key changes the effective rules)."""
        doc = {
            "tenants": {tid: t.to_json() | {"updated_at": 0} for tid, t in self.tenants.items()},
            "keys": sorted(
                (k.tenant, k.name, k.sha256, *((k.team,) if k.team else ()))
                for k in self.active_keys(now)
            ),
            **self._levels_json(),
        }
        canon = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()


def parse_limits(raw: Any) -> list[schema.LimitEntry]:
    """Limit entries in the rules file's shape (a list of mappings), validated strictly."""
    if not isinstance(raw, list):
        raise StateError("limits must be a list of limit entries")
    out: list[schema.LimitEntry] = []
    for i, item in enumerate(raw):
        try:
            # JSON mode: a budget written as 5 is a float, as in the YAML file
            out.append(schema.LimitEntry.model_validate_json(json.dumps(item)))
        except ValueError as exc:
            raise StateError(f"limits[{i}]: {_first_error(exc)}") from exc
    return out


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            msg = "unknown key" if err.get("type") == "extra_forbidden" else err.get("msg", "")
            parts.append(f"{loc}: {msg}" if loc else str(msg))
        return "; ".join(parts)
    return str(exc)


def effective_version(file_version: str, state: StoreState, now: float) -> str:
    """The version of the rules in force: the file's hash alone while the store adds nothing,
    else a hash of both (the same on every replica that runs the same file and store)."""
    if (
        not state.tenants
        and not state.active_keys(now)
        and not state.organisations
        and not (state.teams)
    ):
        return file_version
    both = f"{file_version}:{state.fingerprint(now)}"
    return hashlib.sha256(both.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Merged:
    """The rules file with the store applied, and what of the store could not be."""

    document: schema.ConfigFile
    skipped: tuple[str, ...] = ()


def merge(file_doc: schema.ConfigFile, state: StoreState, now: float) -> Merged:
    """The rules document the replica runs: the file's, with the store's tenants and keys.

    A store tenant naming a plan the file does not define (the file changed since), a limit
    naming an unknown model, or a key of a tenant neither defines is left out and reported in
    ``skipped``; a store tenant without a key is left out while API keys are the only identity
    source (nothing could name it)."""
    skipped: list[str] = []
    tenants: dict[str, schema.TenantEntry] = dict(file_doc.tenants)
    known_models = set(file_doc.models) | {a for m in file_doc.models.values() for a in m.aliases}
    store_keys: dict[str, list[schema.KeyEntry]] = {}
    for k in state.active_keys(now):
        store_keys.setdefault(k.tenant, []).append(
            schema.KeyEntry(name=k.name, sha256=k.sha256, team=k.team or None)
        )
    api_key_only = file_doc.identity.sources == ["api_key"]
    for tid, t in sorted(state.tenants.items()):
        if t.plan not in file_doc.plans:
            skipped.append(f"tenant {tid!r}: plan {t.plan!r} is not in the rules file")
            continue
        bad = [lim.model for lim in t.limits if lim.model != "*" and lim.model not in known_models]
        if bad:
            skipped.append(f"tenant {tid!r}: unknown model {bad[0]!r} in its limits")
            continue
        file_keys = list(file_doc.tenants[tid].keys) if tid in file_doc.tenants else []
        if api_key_only and not file_keys and not store_keys.get(tid):
            continue  # no key yet: nothing can identify it
        tenants[tid] = schema.TenantEntry(
            plan=t.plan,
            keys=file_keys,
            limits=list(t.limits),
            organisation=t.organisation or None,
            team=t.team or None,
        )
    for tid, keys in sorted(store_keys.items()):
        entry = tenants.get(tid)
        if entry is None:
            skipped.extend(f"key {k.name!r}: tenant {tid!r} is defined nowhere" for k in keys)
            continue
        tenants[tid] = entry.model_copy(update={"keys": [*entry.keys, *keys]})
    organisations = {**file_doc.organisations, **state.organisations}
    teams = {**file_doc.teams, **state.teams}
    update: dict[str, Any] = {"tenants": tenants}
    if state.organisations or state.teams:
        update |= {"organisations": organisations, "teams": teams}
    return Merged(file_doc.model_copy(update=update), tuple(skipped))
