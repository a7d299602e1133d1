"""Levels: organisations, teams and end users, compiled into the limits of their keys.

An organisation contains teams; a team contains tenants or single keys; an end user is named
per request.  Each level's limits become :class:`Limit` values of scope ``organisation``,
``team`` or ``user`` (``owner``: the organisation's or team's id) appended to the limits of
every key inside it, so one admission call checks and charges all of them at once
(docs/semantics.md, "Levels").  Pure: :mod:`extproc.config.load` calls it with its own
limit compiler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.config import schema
from extproc.core.rules import WINDOW_SECONDS, Limit

#: Compiles a level's limit entries (``where`` names them in errors).
MakeLimits = Callable[[list[schema.LimitEntry], str], list[Limit]]


@dataclass(slots=True)
class Levels:
    """Every level's compiled limits, and what could not be compiled."""

    organisation_of: dict[str, str] = field(default_factory=dict)  # team -> organisation
    own: dict[tuple[str, str], tuple[Limit, ...]] = field(default_factory=dict)
    strict: set[tuple[str, str]] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    known: set[str] = field(default_factory=set)  # the organisations

    def limits(self, organisation: str, team: str) -> tuple[Limit, ...]:
        """The limits of a key in ``team`` of ``organisation`` (either may be "")."""
        out: tuple[Limit, ...] = ()
        if organisation:
            out += self.own.get(("organisation", organisation), ())
        if team:
            out += self.own.get(("team", team), ())
        return out

    def strict_for(self, organisation: str, team: str) -> bool:
        """Whether the organisation or the team asks for strict streaming."""
        return ("organisation", organisation) in self.strict or ("team", team) in self.strict

    def teams(self) -> dict[str, tuple[str, ...]]:
        """Organisation -> its teams (sorted)."""
        out: dict[str, list[str]] = {o: [] for o in sorted(self.known)}
        for team, org in sorted(self.organisation_of.items()):
            out.setdefault(org, []).append(team)
        return {o: tuple(ts) for o, ts in out.items()}


def compile_levels(cfg: schema.ConfigFile, make: MakeLimits) -> Levels:
    """The levels of ``cfg``: their limits as limits of scope organisation, team and user."""
    lv = Levels()
    for kind, names in (("organisations", cfg.organisations), ("teams", cfg.teams)):
        for name in names:
            if not schema.IDENT.match(name):
                lv.errors.append(f"{kind}.{name}: names may use letters, digits, '.', '_' and '-'")
    lv.known = set(cfg.organisations)
    for org, o in cfg.organisations.items():
        lims = _level(o.limits, f"organisations.{org}.limits", make, lv.errors)
        lv.own[("organisation", org)] = tuple(
            dataclasses.replace(lim, scope="organisation", owner=org) for lim in lims
        )
        if o.charging.streaming == "strict":
            lv.strict.add(("organisation", org))
    for team, t in cfg.teams.items():
        if t.organisation not in cfg.organisations:
            lv.errors.append(f"teams.{team}.organisation: unknown organisation {t.organisation!r}")
            continue
        lv.organisation_of[team] = t.organisation
        lims = [
            dataclasses.replace(lim, scope="team", owner=team)
            for lim in _level(t.limits, f"teams.{team}.limits", make, lv.errors)
        ]
        if t.end_users is not None:
            eu = t.end_users
            lims += [
                dataclasses.replace(lim, scope="user", owner=team)
                for lim in _level(eu.limits, f"teams.{team}.end_users.limits", make, lv.errors)
            ]
            lims.append(
                Limit(
                    "users",
                    eu.max_users,
                    WINDOW_SECONDS.get(eu.per, 0),
                    "*",
                    "team",
                    period=None if eu.per in WINDOW_SECONDS else eu.per,
                    owner=team,
                )
            )
        lv.own[("team", team)] = tuple(lims)
        if t.charging.streaming == "strict":
            lv.strict.add(("team", team))
    return lv


def _level(
    entries: list[schema.LimitEntry], where: str, make: MakeLimits, errors: list[str]
) -> list[Limit]:
    for i, e in enumerate(entries):
        if e.scope != "tenant":
            errors.append(
                f"{where}[{i}].scope: a level's limit is the level's own; 'scope' does not apply"
            )
            return []
    try:
        return make(entries, where)
    except ValueError as exc:
        errors.append(str(exc))
        return []


def organisation_of_tenant(
    tid: str, t: schema.TenantEntry, lv: Levels, errors: list[str]
) -> tuple[str, str]:
    """(organisation, team) of tenant ``tid``: its own, its team's, or its keys' teams' (all
    of one organisation: its keys share one Redis Cluster slot)."""
    team = t.team or ""
    if team and team not in lv.organisation_of:
        errors.append(f"tenants.{tid}.team: unknown team {team!r}")
        return "", ""
    orgs = {lv.organisation_of[team]} if team else set()
    if t.organisation:
        if t.organisation not in lv.known:
            errors.append(f"tenants.{tid}.organisation: unknown organisation {t.organisation!r}")
            return "", ""
        orgs.add(t.organisation)
    for i, k in enumerate(t.keys):
        if k.team is None:
            continue
        if k.team not in lv.organisation_of:
            errors.append(f"tenants.{tid}.keys[{i}].team: unknown team {k.team!r}")
            return "", ""
        orgs.add(lv.organisation_of[k.team])
    if len(orgs) > 1:
        errors.append(
            f"tenants.{tid}: its teams and organisation belong to more than one organisation "
            f"({', '.join(sorted(orgs))}): a tenant is in one organisation"
        )
        return "", ""
    return (orgs.pop() if orgs else ""), team
