"""One check of the level admission rule, shared by the Hypothesis test on the in-memory
limiter (tests/unit/test_levels.py) and the seeded one on the real scripts
(tests/integration/test_levels_scripts.py): a sequence of whole-charge admissions over a
hierarchy, after which no counter of any level is over its limit, and each refusal names a
level whose counter plus the request's charge was over."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from extproc.core.admission_plan import admission_charges, compute_cost, refusal
from extproc.core.keys import ledger_key, windowed
from extproc.core.levels import level_of
from extproc.core.rules import Charging
from extproc.limiter.base import AdmitCall, Limiter


async def check_levels_hold(
    limiter: Limiter,
    tenant: Any,
    requests: Sequence[tuple[str, str, int]],
    *,
    prefix: str,
    now: int,
    counter: Callable[[str], Awaitable[int | None]],
    why: object = "",
) -> None:
    """Admit each (key name, end user, tokens) of tenant ``x`` at ``now``, then compare every
    TPM counter with the sum of what was admitted into it (``counter`` reads one)."""
    totals: dict[str, int] = {}
    limits: dict[str, int] = {}
    for n, (key, user, tokens) in enumerate(requests):
        bs = windowed(prefix, tenant.slot, key, tenant.limits_for(key), now, user=user)
        cost = compute_cost(
            input_tokens=tokens, per_choice_max=0, n=1, stream=False, charging=Charging()
        )
        res = await limiter.admit(
            AdmitCall(
                ledger_key(prefix, tenant.slot, f"r{n}"),
                admission_charges(bs, cost),
                tpm_charged=tokens,
                count_refused=False,
                ledger_ttl_ms=60_000,
            )
        )
        for b in bs:
            limits[b.key] = b.limit.limit
        if res.admitted:
            for b in bs:
                if b.kind == "tpm":
                    totals[b.key] = totals.get(b.key, 0) + tokens
            continue
        err = refusal(bs, res.values, cost, now, tenant="x", model="m")
        out = [
            level_of(b, "x")
            for b, v in zip(bs, res.values, strict=True)
            if b.kind == "tpm" and v + tokens > b.limit.limit
        ]
        assert out, (why, "refused with every level in room")
        assert tuple(err.level.split("=", 1)) in out, (why, err.message)
    for k, total in totals.items():
        assert total <= limits[k], (why, k)
        assert await counter(k) == total, (why, k)
