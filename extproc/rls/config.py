"""A compiled envoyproxy/ratelimit config: every domain's descriptor tree (:class:`Domain`,
:class:`Node`), the ``rate_limit`` rules in it (:class:`Rule`, with the ai-quota bucket it may
count in, :class:`BucketLink`), and :class:`RlsConfigError`.  The YAML format is parsed by
:mod:`extproc.rls.parse`; files are read and compiled by :mod:`extproc.rls.load`; descriptors are
matched against the tree by :mod:`extproc.rls.match`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

#: Seconds per unit, epoch-aligned like theirs (a month is 30 days, a year 365).
UNIT_SECONDS: dict[str, int] = {
    "second": 1,
    "minute": 60,
    "hour": 3600,
    "day": 86400,
    "week": 7 * 86400,
    "month": 30 * 86400,
    "year": 365 * 86400,
}
_SAFE_TENANT = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RlsConfigError(ValueError):
    """The config does not load; ``errors`` holds one ``file:line: path: message`` each."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors))


@dataclass(frozen=True, slots=True)
class BucketLink:
    """A rule that counts in an ai-quota bucket: the ``bucket`` (``rpm`` or ``tpm``) of the
    tenant named by the value of entry ``tenant`` (a key on the rule's path), for ``model``
    (``*``: the tenant-wide bucket, or the key of an entry naming the model).  The indexes are
    the keys' positions on the path: the tenant is the value of the entry the tree matched at
    that level, never another entry of the same key."""

    bucket: Literal["rpm", "tpm"]
    tenant_key: str
    model_key: str = "*"
    tenant_index: int = 0
    model_index: int = -1  # -1: the tenant-wide bucket
    # whose bucket the entry names (docs/semantics.md, "Levels"): a tenant, or an organisation
    # or team (their own limits' counters, shared with the gateway's admissions)
    level: Literal["tenant", "organisation", "team"] = "tenant"


@dataclass(frozen=True, slots=True)
class Rule:
    """A ``rate_limit`` block with the flags of the descriptor that holds it."""

    path: str  # their stat key: "domain.key_value.key" (values of value-less keys left out)
    unit: str  # "" when unlimited
    requests_per_unit: int
    unlimited: bool = False
    unit_multiplier: int = 1  # the window is this many units
    name: str = ""
    replaces: tuple[str, ...] = ()
    shadow_mode: bool = False
    quota_mode: bool = False
    detailed_metric: bool = False
    metadata: dict[str, Any] | None = None
    link: BucketLink | None = None

    @property
    def window_s(self) -> int:
        """The window's length in seconds (0 when unlimited)."""
        return UNIT_SECONDS.get(self.unit, 0) * self.unit_multiplier


@dataclass(slots=True)
class Node:
    """One level of a domain's descriptor tree."""

    key: str
    value: str
    rule: Rule | None
    share_threshold: bool = False
    children: dict[tuple[str, str], Node] = field(default_factory=dict)
    # wildcard children in declaration order: (key, value split on "*", node)
    wildcards: list[tuple[str, tuple[str, ...], Node]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Domain:
    """A domain's tree (the root node has no key), the file it came from, and whether a
    descriptor's ``limit`` override from Envoy applies (``allow_limit_override``)."""

    name: str
    root: Node
    source: str
    allow_override: bool = False


@dataclass(frozen=True, slots=True)
class RlsConfig:
    """Every domain, by name."""

    domains: dict[str, Domain] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    @property
    def rules(self) -> int:
        """How many rate_limit blocks the config holds."""
        count = 0
        for d in self.domains.values():
            stack = [d.root]
            while stack:
                n = stack.pop()
                count += n.rule is not None
                stack.extend(n.children.values())
                stack.extend(w[2] for w in n.wildcards)
        return count


def valid_tenant(value: str) -> bool:
    """Whether a descriptor value can name a tenant in a key (what bucket links accept)."""
    return bool(_SAFE_TENANT.match(value))
