"""The usage record: one per finished request, the unit an operator bills from.

Pure data (no IO): how a record becomes the flat string fields of a Redis Stream entry and back,
and the column order that CSV and JSONL exports share.  A field added later gets a default, so
``from_fields`` reads entries written by older and newer versions alike (unknown fields are
ignored); ``v`` in the stream entry is the schema version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from extproc.core.admission_vocabulary import DraftRecord

SCHEMA_VERSION = "1"

#: The record's fields in export order (CSV columns; JSONL keys follow the same order).
FIELDS: tuple[str, ...] = (
    "record_id",
    "request_id",
    "tenant",
    "key",
    "model",
    "api",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cost",
    "currency",
    "ending",
    "status",
    "admitted_at_ms",
    "finished_at_ms",
    "input_check",
    "input_reported",
    "organisation",
    "team",
    "end_user",
    "waited_ms",
)

#: ``input_check``: how the input was billed, when it was not simply counted (docs/
#: usage-records.md): ``uncounted`` at the upstream's own figure without a count (admitted on
#: a bound; re-bill these if the upstream is later found to under-report), ``low``/``high`` the
#: upstream's figure disagreed with the count (billed at the nearest bound).
INPUT_CHECKS = ("", "uncounted", "low", "high")

_INTS = (
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "admitted_at_ms",
    "finished_at_ms",
    "waited_ms",
)


class RecordFormatError(ValueError):
    """A stream entry that is not a usage record."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one finished request used.

    ``cost`` is in ``currency`` at the model's prices for what was settled (cached input and
    reasoning at theirs), exact to a micro-unit.  ``record_id`` identifies the record itself (the recorder fills it in when empty): unlike
    ``request_id`` (Envoy's ``x-request-id``, which a client may choose and repeat) it is unique,
    so it is the key to deduplicate on downstream.  ``key`` is the API key's *name*, never the
    secret.  ``cached_input_tokens`` are part of ``input_tokens`` and ``reasoning_tokens`` part of
    ``output_tokens`` (the OpenAI convention).  ``cost`` is None until the model is priced.
    ``status`` is the upstream's HTTP status, None when the request ended before one arrived.
    """

    request_id: str
    tenant: str
    key: str
    model: str
    api: str
    input_tokens: int
    output_tokens: int
    ending: str
    admitted_at_ms: int
    finished_at_ms: int
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    cost: Decimal | None = None
    status: int | None = None
    record_id: str = ""
    currency: str = ""  # of ``cost`` (an ISO 4217 code); empty while unpriced
    # how the input was billed when not simply counted (:data:`INPUT_CHECKS`), and the
    # upstream's own input figure then (None: not reported, or nothing to flag)
    input_check: str = ""
    input_reported: int | None = None
    # the levels the request was counted in (docs/semantics.md, "Levels"): its tenant's
    # organisation, its key's team, and the end user it named ("" none; a reclaimed request's
    # end user is not known)
    organisation: str = ""
    team: str = ""
    end_user: str = ""
    # how long the request waited for its turn before admission (docs/semantics.md, "Waiting")
    waited_ms: int = 0

    def to_fields(self) -> dict[str, str]:
        """The flat string fields of the stream entry (None is written as an empty string)."""
        out = {"v": SCHEMA_VERSION}
        for name in FIELDS:
            value = getattr(self, name)
            out[name] = "" if value is None else str(value)
        return out

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> UsageRecord:
        """Read a stream entry's fields (bytes or str keys and values)."""
        f = {_text(k): _text(v) for k, v in fields.items()}
        try:
            ints = {name: int(f.get(name) or 0) for name in _INTS}
            status = f.get("status") or ""
            cost = f.get("cost") or ""
            reported = f.get("input_reported") or ""
            return cls(
                record_id=f.get("record_id", ""),
                request_id=f["request_id"],
                tenant=f["tenant"],
                key=f.get("key", ""),
                model=f.get("model", ""),
                api=f.get("api", ""),
                ending=f.get("ending", ""),
                status=int(status) if status else None,
                cost=Decimal(cost) if cost else None,
                currency=f.get("currency", ""),
                input_check=f.get("input_check", ""),
                input_reported=int(reported) if reported else None,
                organisation=f.get("organisation", ""),
                team=f.get("team", ""),
                end_user=f.get("end_user", ""),
                **ints,
            )
        except (KeyError, ValueError, InvalidOperation) as exc:
            raise RecordFormatError(f"not a usage record: {exc!r}") from exc

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict in ``FIELDS`` order (``cost`` as a decimal string: money is never
        a binary float)."""
        out: dict[str, Any] = {}
        for name in FIELDS:
            value = getattr(self, name)
            out[name] = str(value) if isinstance(value, Decimal) else value
        return out

    def to_row(self) -> list[str]:
        """The CSV row in ``FIELDS`` order (None as an empty cell)."""
        return ["" if (v := getattr(self, name)) is None else str(v) for name in FIELDS]


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes | bytearray) else str(value)


def record_id_for(ledger: str) -> str:
    """The record id of the request behind ``ledger`` (its Redis ledger key, unique per HTTP
    request): every record of one request carries the same id, whoever writes it."""
    return hashlib.sha256(ledger.encode()).hexdigest()[:32]


#: The ending of a record written for a request whose processor died before settling it.
RECLAIMED = "reclaimed"


@dataclass(frozen=True, slots=True)
class RecordDraft(DraftRecord):
    """What admission knows of a request's record (admission's own
    :class:`~extproc.core.admission_vocabulary.DraftRecord`, the same fields), kept in its
    ledger while it is open.

    If the processor dies, the tenant's next admission reclaims the reservation and hands the
    draft back, with the tokens the ledger had charged by then, so that a record is still
    written (:meth:`reclaimed`)."""

    def to_json(self) -> str:
        """The draft as stored in the ledger (compact JSON)."""
        return draft_json(self)

    @classmethod
    def from_json(cls, raw: str | bytes) -> RecordDraft:
        """Read a stored draft (:class:`RecordFormatError` if it is not one)."""
        try:
            v, rid, tenant, key, model, api, inp, reserved, at = orjson.loads(raw)
            if v != 1:
                raise ValueError(f"draft version {v!r}")
            return cls(rid, tenant, key, model, api, int(inp), int(reserved), int(at))
        except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
            raise RecordFormatError(f"not a record draft: {exc!r}") from exc

    def reclaimed(
        self,
        ledger: str,
        finished_at_ms: int,
        *,
        input_tokens: int,
        output_tokens: int,
        cost: Decimal | None = None,
        currency: str = "",
    ) -> UsageRecord:
        """The record of a request reclaimed from a dead processor, with the figures the core
        bills it (:func:`extproc.core.policies.reclaimed_billing`: the exact input its
        processor noted, else the draft's; the output its stream charges had billed)."""
        return UsageRecord(
            request_id=self.request_id,
            tenant=self.tenant,
            key=self.key,
            model=self.model,
            api=self.api,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            ending=RECLAIMED,
            admitted_at_ms=self.admitted_at_ms,
            finished_at_ms=finished_at_ms,
            cost=cost,
            currency=currency if cost is not None else "",
            record_id=record_id_for(ledger),
        )


def draft_json(d: DraftRecord) -> str:
    """A draft as stored in the ledger (compact JSON; :meth:`RecordDraft.from_json` reads it):
    written straight from admission's draft on the hot path, no :class:`RecordDraft` made."""
    return orjson.dumps(
        [
            1,
            d.request_id,
            d.tenant,
            d.key,
            d.model,
            d.api,
            d.input_tokens,
            d.reserved_output,
            d.admitted_at_ms,
        ]
    ).decode()
