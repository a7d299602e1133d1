"""The exact input of a request admitted on a bound reaches its open ledger (issue 23, defect
1): a request still open a moment after its admission is counted off its path and the count
noted; if its processor then dies, the reclaim bills that count, not the bound.  A request that
settles sooner is never counted."""

from __future__ import annotations

import asyncio
import time

import pytest

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from tests.unit.test_input_bound import RULES, complete_json, request

pytestmark = pytest.mark.unit


def notes(gw: Gateway, outcome: str) -> float:
    return gw.metrics.registry.get_sample_value("aiq_input_notes_total", {"outcome": outcome}) or 0


def tokenized(gw: Gateway) -> float:
    return gw.metrics.registry.get_sample_value("aiq_tokenize_seconds_count", {"api": "chat"}) or 0


async def test_a_dead_request_admitted_on_its_bound_is_reclaimed_to_its_exact_input() -> None:
    clock = FakeClock()
    lim = MemoryLimiter(clock)
    cfg = load_config_text(RULES % ("lazy", 1000, 1.0, 1_000_000))
    gw = Gateway(config=cfg, limiter=lim, clock=clock, metrics=Metrics())
    first, _ = await request(gw, 1)  # counted first: nothing known of the counters yet
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact)
    assert tokenized(gw) == 1
    [tpm] = [b.key for b in first.s.buckets if b.kind == "tpm"]
    [after_first] = await lim.read([tpm])

    quick, _ = await request(gw, 2)  # on the bound, answered at once: never counted
    assert quick.s.input_pending
    await complete_json(quick, exact)
    [after_quick] = await lim.read([tpm])
    assert after_quick - after_first == exact + 5 and tokenized(gw) == 1

    dying, _ = await request(gw, 3)  # on the bound; its processor will die
    assert dying.s.cost is not None and dying.s.input_pending
    bound = dying.s.cost.input_tokens
    assert bound > exact + 100
    deadline = time.monotonic() + 5
    while notes(gw, "written") < 1:  # counted 0.25 s after admission, noted in its ledger
        assert time.monotonic() < deadline, "the exact input was never noted"
        await asyncio.sleep(0.01)
    assert tokenized(gw) == 2
    # the processor dies: nothing settles it; its lease runs out
    clock.advance(cfg.reservation_lease_ms / 1000 + 1)
    reclaimer, _ = await request(gw, 4)  # on the bound too; it reclaims the dead one
    assert reclaimer.s.cost is not None
    [now] = await lim.read([tpm])
    # the dead request keeps its exact input (bound and reserved output refunded), the new
    # one holds its bound and reservation
    assert now - after_quick == exact + (bound + 10)
    assert lim.ledger_state(dying.s.ledger) == "reclaimed"
