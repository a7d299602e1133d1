"""A processor that dies holding reservations leaks them only until its lease runs out: the
tenant's next admission refunds the reserved output (admit.lua), a live processor renewing its
lease keeps it, and a late settlement of a reclaimed ledger puts it back first (the limiter
contract: every backend, in-memory, Redis and Redis Cluster)."""

from __future__ import annotations

import uuid

import pytest

from extproc.core.policies import reclaimed_billing
from extproc.core.rules import Adjustment, BucketCharge
from extproc.limiter.base import AdmitCall, AdmitResult, InputNote, Limiter
from extproc.records.model import RecordDraft, record_id_for
from tests.helpers import far_ms
from tests.limiters import Backend

pytestmark = pytest.mark.integration

TTL = 600_000
LEASE = 10_000


def setup() -> tuple[str, list[BucketCharge]]:
    tag = f"aiq:{{r-{uuid.uuid4().hex[:8]}}}"
    return tag, [
        BucketCharge(f"{tag}:rpm", "rpm", 1, 100, far_ms()),
        BucketCharge(
            f"{tag}:tpm", "tpm", 1_010, 100_000, far_ms(), refundable=1_000
        ),  # 10 + 1000 reserved
    ]


async def admit(
    lim: Limiter, tag: str, charges: list[BucketCharge], now: int, n: int, draft: str = ""
) -> AdmitResult:
    res = await lim.admit(
        AdmitCall(
            f"{tag}:req:{n}",
            charges,
            tpm_charged=1_010,
            count_refused=False,
            ledger_ttl_ms=TTL,
            now_ms=now,
            lease_until_ms=now + LEASE,
            record_draft=draft,
        )
    )
    assert res.admitted
    return res


async def test_dead_reservation_is_refunded_by_the_next_admission(backend: Backend) -> None:
    """A reservation whose lease ran out is refunded by the tenant's next admission, not before."""
    lim = backend.limiter
    r = backend.probe
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)  # its processor dies: never settled
    assert (await r.counter(f"{tag}:tpm") or 0) == 1_010
    await admit(lim, tag, charges, now + LEASE - 1, 2)  # lease still running: nothing back
    assert (await r.counter(f"{tag}:tpm") or 0) == 2_020
    await admit(lim, tag, charges, now + LEASE + 1, 3)  # lease over: 1's reservation back
    assert (await r.counter(f"{tag}:tpm") or 0) == 2_020 - 1_000 + 1_010
    assert await r.ledger_state(f"{tag}:req:1") == "reclaimed"
    assert await r.score(f"{tag}:open", f"{tag}:req:1") is None


async def test_renewed_lease_is_not_reclaimed(backend: Backend) -> None:
    """A renewed lease keeps its reservation past the first deadline."""
    lim = backend.limiter
    r = backend.probe
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)
    await lim.renew([f"{tag}:req:1"], now + 3 * LEASE)
    await admit(lim, tag, charges, now + 2 * LEASE, 2)
    assert (await r.counter(f"{tag}:tpm") or 0) == 2_020
    assert await r.ledger_state(f"{tag}:req:1") == "admitted"


async def test_settled_reservation_leaves_the_open_set_and_is_never_reclaimed(
    backend: Backend,
) -> None:
    """A settled reservation leaves the open set for good: no renewal, no reclaim."""
    lim = backend.limiter
    r = backend.probe
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)
    await lim.settle(f"{tag}:req:1", [Adjustment(f"{tag}:tpm", -900, far_ms())], ledger_ttl_ms=TTL)
    await lim.renew([f"{tag}:req:1"], now + 5 * LEASE)  # XX: a settled one is not re-added
    assert await r.score(f"{tag}:open", f"{tag}:req:1") is None
    await admit(lim, tag, charges, now + 2 * LEASE, 2)
    assert (await r.counter(f"{tag}:tpm") or 0) == 110 + 1_010


async def test_late_settlement_of_a_reclaimed_ledger_is_exact(backend: Backend) -> None:
    """The processor was alive but its renewals were lost: settlement restores, then corrects."""
    lim = backend.limiter
    r = backend.probe
    tag, charges = setup()
    now = 1_700_000_000_000
    await admit(lim, tag, charges, now, 1)
    await admit(lim, tag, charges, now + LEASE + 1, 2)  # reclaims 1
    # 1 really generated 300 tokens: its processor settles 1010 -> 310 (-700)
    await lim.settle(f"{tag}:req:1", [Adjustment(f"{tag}:tpm", -700, far_ms())], ledger_ttl_ms=TTL)
    assert (await r.counter(f"{tag}:tpm") or 0) == 310 + 1_010


async def test_a_reclaimed_request_hands_back_its_record_draft_once(backend: Backend) -> None:
    """The draft an admission leaves in its ledger comes back, once, to the admission that
    reclaims it, with what the ledger had charged (input, reservation, stream charges); a
    settled request's draft is dropped and never comes back."""
    lim = backend.limiter
    r = backend.probe
    tag, charges = setup()
    now = 1_700_000_000_000
    draft = RecordDraft("req-1", "t", "k", "m", "chat", 10, 1_000, now).to_json()
    other = RecordDraft("req-2", "t", "k", "m", "chat", 10, 1_000, now).to_json()
    for n, d in ((1, draft), (2, other)):
        assert (await admit(lim, tag, charges, now, n, d)).reclaimed == ()
    # request 1 streamed 1,500 tokens past its reservation before its processor died
    stream = [BucketCharge(f"{tag}:tpm", "tpm", 0, 100_000, far_ms())]
    assert (
        await lim.charge(f"{tag}:req:1", 1, stream, 1_500, strict=False, ledger_ttl_ms=TTL)
    ).granted == 1_500
    # request 2 was settled by its processor: its draft is gone
    assert await lim.settle(f"{tag}:req:2", [], ledger_ttl_ms=TTL)
    assert await r.ledger_draft(f"{tag}:req:2") is None

    res = await admit(lim, tag, charges, now + LEASE + 1, 3)
    assert [(x.ledger, x.draft, x.charged) for x in res.reclaimed] == [
        (f"{tag}:req:1", draft, 1_010 + 1_500)
    ]
    got = RecordDraft.from_json(res.reclaimed[0].draft)
    bill = reclaimed_billing(
        charged=res.reclaimed[0].charged,
        draft_input=got.input_tokens,
        reserved_output=got.reserved_output,
        noted_input=res.reclaimed[0].input,
        prices=None,
    )
    rec = got.reclaimed(
        res.reclaimed[0].ledger,
        now + LEASE + 1,
        input_tokens=bill.input,
        output_tokens=bill.output,
    )
    assert (rec.input_tokens, rec.output_tokens, rec.ending) == (10, 1_500, "reclaimed")
    assert rec.record_id == record_id_for(f"{tag}:req:1")
    # the counter keeps input and the stream charge of 1, all of 2 (settled as admitted), and 3
    assert (await r.counter(f"{tag}:tpm") or 0) == 10 + 1_500 + 1_010 + 1_010
    # once: a later reclaim pass finds nothing (the draft left the ledger)
    assert await r.ledger_draft(f"{tag}:req:1") is None
    res = await admit(lim, tag, charges, now + 3 * LEASE, 4)
    # 3 left no draft (its admission wrote none): reclaimed, no record handed back
    assert res.reclaimed == () and await r.ledger_state(f"{tag}:req:3") == "reclaimed"


async def test_an_exact_input_noted_in_the_ledger_is_refunded_by_the_reclaim(
    backend: Backend,
) -> None:
    """Issue 23, defect 1: a request admitted on an upper bound of its input notes its exact
    count in its open ledger; the reclaim then gives back the rest of the bound with the
    reservation, and hands the exact input back with the draft.  A note comes once, and never
    to a ledger that is settled or gone."""
    lim = backend.limiter
    r = backend.probe
    tag, charges = setup()  # admitted on a bound of 10 input tokens; the exact count is 4
    now = 1_700_000_000_000
    draft = RecordDraft("rid", "t", "k", "m", "chat", 10, 1_000, now).to_json()
    await admit(lim, tag, charges, now, 1, draft)
    note = InputNote(f"{tag}:req:1", 4, ((f"{tag}:tpm", 6),))
    assert await lim.note_inputs([note]) == [True]  # type: ignore[attr-defined]
    assert await lim.note_inputs([note]) == [False]  # type: ignore[attr-defined]
    assert await lim.note_inputs(  # type: ignore[attr-defined]
        [InputNote(f"{tag}:req:gone", 4, ((f"{tag}:tpm", 6),))]
    ) == [False]
    res = await admit(lim, tag, charges, now + LEASE + 1, 2)
    assert (await r.counter(f"{tag}:tpm") or 0) == 4 + 1_010  # 1 keeps its exact input only
    assert [(x.ledger, x.charged, x.input) for x in res.reclaimed] == [(f"{tag}:req:1", 1_010, 4)]
    # settled first: a late note changes nothing
    await lim.settle(f"{tag}:req:2", [], ledger_ttl_ms=TTL)
    assert await lim.note_inputs(  # type: ignore[attr-defined]
        [InputNote(f"{tag}:req:2", 4, ((f"{tag}:tpm", 6),))]
    ) == [False]
