"""Per-request account of what was charged to each per-token counter, and the corrections
settlement applies.

Every charge is recorded with the window buckets it went to, so a refund goes back to the
window the units were taken from (newest first), and a shortfall is charged to the current
window.  Each limit is settled on its own: a TPM counter and a money budget charged for the
same tokens get corrections in their own units (the budget's at the model's prices, cached
input and reasoning at theirs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.core.keys import WindowedBucket
from extproc.core.rules import Adjustment, Limit, Usage


@dataclass(slots=True)
class RequestAccount:
    """What one request has been charged, per bucket, and how many tokens that was."""

    # (bucket, units added to it), in the order charged
    charges: list[tuple[WindowedBucket, int]] = field(default_factory=list)
    tokens: int = 0

    def record(self, buckets: list[WindowedBucket], usage: Usage) -> None:
        """Remember that ``usage`` was charged to the per-token buckets among ``buckets``."""
        self.tokens += usage.tokens
        for b in buckets:
            if b.limit.counts_tokens:
                units = b.rates.units(usage)
                if units:
                    self.charges.append((b, units))

    def record_output(self, buckets: list[WindowedBucket], tokens: int) -> None:
        """A stream charge of ``tokens`` output tokens (the units charge.lua added)."""
        self.tokens += tokens
        for b in buckets:
            if b.limit.counts_tokens:
                units = b.rates.output_units(tokens)
                if units:
                    self.charges.append((b, units))

    @property
    def total(self) -> int:
        """Tokens charged so far (what a TPM counter holds for this request)."""
        return self.tokens

    def charged(self, limit: Limit) -> int:
        """Units charged so far to ``limit``'s counters."""
        # ``is`` first: the same Limit object almost always (a dataclass ``==`` compares
        # every field; an object is equal to itself all the same)
        return sum(u for b, u in self.charges if b.limit is limit or b.limit == limit)

    def adjustments(self, final: Usage, current: list[WindowedBucket]) -> list[Adjustment]:
        """Corrections that make every per-token counter hold the units of ``final``."""
        out: dict[str, list[int]] = {}
        for b in current:
            if not b.limit.counts_tokens:
                continue
            delta = b.rates.units(final) - self.charged(b.limit)
            if delta > 0:
                out.setdefault(b.key, [0, b.expire_at_ms])[0] += delta
            elif delta < 0:
                left = -delta
                for cb, units in reversed(self.charges):
                    if cb.limit is not b.limit and cb.limit != b.limit:
                        continue
                    take = min(left, units)
                    out.setdefault(cb.key, [0, cb.expire_at_ms])[0] -= take
                    left -= take
                    if left == 0:
                        break
        return [Adjustment(k, v[0], v[1]) for k, v in out.items() if v[0] != 0]
