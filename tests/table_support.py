"""What the state-machine table tests share: the states a transition table leads to."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

StateT = TypeVar("StateT", bound=Hashable)


def reachable(
    table: Mapping[tuple[StateT, Any], tuple[Any, frozenset[StateT]]], start: StateT
) -> set[StateT]:
    """The states ``table`` ((state, event type) -> (step, the states it may lead to)) leads
    to from ``start``."""
    seen, todo = {start}, [start]
    while todo:
        state = todo.pop()
        for (src, _), (_, allowed) in table.items():
            if src == state:
                for nxt in allowed - seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return seen
