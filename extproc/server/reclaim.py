"""Usage records of requests whose processor died (SIGKILL, OOM, a lost machine) before settling
them.

Admission leaves a record draft in each open request's ledger.  When the request's lease runs
out unrenewed, the tenant's next admission reclaims it in its Lua call (the reservation goes
back) and hands the draft back, once; this module turns it into the request's usage record:
input as counted (for a request admitted on an upper bound of its input, the exact count its
processor noted in the ledger, when it had), output as the stream charges had billed it,
ending ``reclaimed``.  Its
``record_id`` is the one the request's own settlement would have used, so a processor that was
alive after all (its lease renewals were lost) and settles later writes a record that replaces
it downstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import structlog

from extproc.config.runtime import RuntimeConfig
from extproc.core.policies import reclaimed_billing
from extproc.gateway import Gateway
from extproc.limiter.base import Reclaimed
from extproc.records.model import RecordDraft, RecordFormatError

log = structlog.get_logger("extproc")


def record_reclaimed(gw: Gateway, cfg: RuntimeConfig, reclaimed: Sequence[Reclaimed]) -> None:
    """Usage records of requests whose processor died before settling them, from the drafts
    their admissions left in the ledgers (the reclaim is their settlement)."""
    now = gw.clock.now_ms()
    for r in reclaimed:
        try:
            draft = RecordDraft.from_json(r.draft)
        except RecordFormatError as exc:
            log.error("reclaimed_record_unreadable", ledger=r.ledger, error=str(exc))
            continue
        model = cfg.resolve_model(draft.model)
        priced = model is not None and model.prices is not None and bool(model.currency)
        bill = reclaimed_billing(
            charged=r.charged,
            draft_input=draft.input_tokens,
            reserved_output=draft.reserved_output,
            noted_input=r.input,
            prices=model.prices if priced and model is not None else None,
        )
        inp, out, cost = bill.input, bill.output, bill.money
        log.warning(
            "reclaimed",
            request_id=draft.request_id,
            tenant=draft.tenant,
            input_tokens=inp,
            output_tokens=out,
            note="its processor died before settling it",
        )
        if gw.recorder is not None:
            currency = model.currency if model is not None else ""
            rec = draft.reclaimed(
                r.ledger, now, input_tokens=inp, output_tokens=out, cost=cost, currency=currency
            )
            tenant = cfg.tenants.get(draft.tenant)
            if tenant is not None and tenant.organisation:  # its levels under the rules now
                rec = replace(rec, organisation=tenant.organisation, team=tenant.team_of(draft.key))
            gw.recorder.record(rec)
