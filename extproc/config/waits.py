"""The plans' waits (docs/semantics.md, "Waiting"), compiled from the rules file."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.config import schema
from extproc.config.wait_schema import WaitEntry
from extproc.core.waiting import WaitRule


def wait_rules(plans: Mapping[str, schema.PlanEntry]) -> dict[str, WaitRule]:
    """Plan name -> its wait, for the plans that wait."""
    return {name: _rule(p.wait) for name, p in plans.items() if p.wait is not None}


def key_wait_rules(tenants: Mapping[str, schema.TenantEntry]) -> dict[tuple[str, str], WaitRule]:
    """(tenant, key name) -> the key's own wait, for the keys that have one."""
    return {
        (tid, k.name): _rule(k.wait)
        for tid, t in tenants.items()
        for k in t.keys
        if k.wait is not None
    }


def _rule(w: WaitEntry) -> WaitRule:
    return WaitRule(
        max_ms=round(w.max_seconds * 1000),
        max_waiters=w.max_waiters,
        priority=w.priority,
        max_priority=w.max_priority,
        boost_ms=round(w.priority_boost_seconds * 1000),
    )
