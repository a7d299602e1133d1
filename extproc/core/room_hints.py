"""What the per-token counters held after the last admission that read them
(:class:`RoomHints`): whether admission may decide on an upper bound of the input
(:mod:`extproc.core.admission_flow`).  A hint, never a decision.  Sans-IO."""

from __future__ import annotations

from extproc.core.rules import BucketCharge

#: Most bucket keys :class:`RoomHints` remembers (cleared when reached; keys carry their
#: window, so old windows' entries are dead weight).
MAX_ROOM_HINTS = 65_536


class RoomHints:
    """What each per-token counter held after the last admission that read it: a hint, never
    a decision (the admission script decides atomically).

    Admission on an upper bound of the input (:func:`extproc.core.counters.upper_bound_counter`)
    reserves more than the request needs until the exact count replaces it; :meth:`ample`
    allows that only where the counters were far from their limits, so the bound can neither
    turn the admission's answer nor crowd out a tenant's other requests near its limit."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._values)

    def note(self, charges: list[BucketCharge], values: tuple[int, ...]) -> None:
        """Remember the per-token counters' values an admission answered with."""
        seen = self._values
        if len(seen) >= MAX_ROOM_HINTS:
            seen.clear()
        for c, v in zip(charges, values, strict=False):
            if c.kind == "tpm":
                seen[c.key] = v

    def ample(
        self,
        charges: list[BucketCharge],
        headroom: float,
        then: dict[str, int] | None = None,
        *,
        share: float = 1.0,
    ) -> bool:
        """Whether every per-token counter (shadow ones aside) was last seen so far from its
        limit that ``headroom`` times the charge, plus ``then[key]`` units the request may add
        later (a stream's whole output: its own cut must not come earlier for the bound), stay
        within ``share`` of the limit; False when any was never seen.  The share caps what
        many bounds admitted at once can hold beyond their counts."""
        seen = self._values
        for c in charges:
            if c.kind != "tpm" or c.shadow or c.amount <= 0:
                continue
            v = seen.get(c.key)
            later = then.get(c.key, 0) if then else 0
            if v is None or v + headroom * c.amount + later > c.limit * share:
                return False
        return True
