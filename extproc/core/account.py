"""Per-request account of TPM charges, and the corrections settlement applies.

Every charge is recorded with the window buckets it went to, so a refund goes back to the
window the tokens were taken from (newest first), and a shortfall is charged to the current
window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.core.keys import WindowedBucket
from extproc.core.rules import Adjustment


@dataclass(slots=True)
class RequestAccount:
    """What one request has been charged, in TPM tokens, and where."""

    charges: list[tuple[list[WindowedBucket], int]] = field(default_factory=list)

    def record(self, buckets: list[WindowedBucket], amount: int) -> None:
        """Remember that ``amount`` was added to the TPM buckets among ``buckets``."""
        tpm = [b for b in buckets if b.metric == "tpm"]
        if amount > 0 and tpm:
            self.charges.append((tpm, amount))

    @property
    def total(self) -> int:
        """Tokens charged so far."""
        return sum(a for _, a in self.charges)

    def adjustments(self, final_total: int, current: list[WindowedBucket]) -> list[Adjustment]:
        """Corrections that make the charged total equal ``final_total``."""
        delta = final_total - self.total
        out: dict[str, list[int]] = {}
        if delta > 0:
            for b in current:
                if b.metric == "tpm":
                    out.setdefault(b.key, [0, b.expire_at_ms])[0] += delta
        elif delta < 0:
            left = -delta
            for buckets, amount in reversed(self.charges):
                take = min(left, amount)
                for b in buckets:
                    out.setdefault(b.key, [0, b.expire_at_ms])[0] -= take
                left -= take
                if left == 0:
                    break
        return [Adjustment(k, v[0], v[1]) for k, v in out.items() if v[0] != 0]
