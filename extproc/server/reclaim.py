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
from decimal import Decimal

import structlog

from extproc.config.runtime import RuntimeConfig
from extproc.core.rules import Usage
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
        out = draft.output_charged(r.charged)
        # the exact count noted in the ledger (the bound admission charged was refunded down
        # to it), else the draft's figure
        inp = r.input if r.input >= 0 else draft.input_tokens
        model = cfg.resolve_model(draft.model)
        cost: Decimal | None = None
        if model is not None and model.prices is not None and model.currency:
            micros = model.prices.units(Usage(input=inp, output=out))
            cost = Decimal(micros).scaleb(-6)
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
            gw.recorder.record(
                draft.reclaimed(
                    r.ledger, r.charged, now, cost=cost, currency=currency, input_tokens=inp
                )
            )
