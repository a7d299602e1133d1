"""The plans' waits (docs/semantics.md, "Waiting"), compiled from the rules file."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.config import schema
from extproc.core.waiting import WaitRule


def wait_rules(plans: Mapping[str, schema.PlanEntry]) -> dict[str, WaitRule]:
    """Plan name -> its wait, for the plans that wait."""
    return {
        name: WaitRule(
            max_ms=round(p.wait.max_seconds * 1000),
            max_waiters=p.wait.max_waiters,
            priority=p.wait.priority,
            max_priority=p.wait.max_priority,
            boost_ms=round(p.wait.priority_boost_seconds * 1000),
        )
        for name, p in plans.items()
        if p.wait is not None
    }
