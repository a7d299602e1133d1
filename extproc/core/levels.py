"""How refusals, cuts and headers name the level a bucket belongs to (docs/semantics.md,
"Levels"): the tenant, its organisation, its team, or one end user of a team."""

from __future__ import annotations

from extproc.core.keys import WindowedBucket


def end_user_of(b: WindowedBucket) -> str:
    """The end user a per-user bucket counts, as its key names it (an odd or long id is a
    digest: :func:`extproc.core.keys.user_segment`)."""
    marker = f":u.{b.limit.owner}."
    i = b.key.find(marker)
    if i < 0:
        return ""
    return b.key[i + len(marker) :].split(":", 1)[0]


def level_of(b: WindowedBucket, tenant: str) -> tuple[str, str]:
    """(kind, id) of the level whose limit ``b`` is: ``tenant``, ``organisation``, ``team``
    or ``user`` (id ``team/user``)."""
    scope = b.limit.scope
    if scope == "organisation":
        return "organisation", b.limit.owner
    if scope == "team":
        return "team", b.limit.owner
    if scope == "user":
        return "user", f"{b.limit.owner}/{end_user_of(b)}"
    return "tenant", tenant


def level_label(b: WindowedBucket, tenant: str) -> str:
    """How a message names the level: ``organisation acme``, ``team research``, ``end user u1
    of team research``, ``tenant acme``."""
    kind, ident = level_of(b, tenant)
    if kind == "user":
        team, _, user = ident.partition("/")
        return f"end user {user} of team {team}"
    return f"{kind} {ident}"


def level_header(b: WindowedBucket, tenant: str) -> str:
    """A level as a header value: ``organisation=acme``, ``user=research/u1``."""
    kind, ident = level_of(b, tenant)
    return f"{kind}={ident}"
