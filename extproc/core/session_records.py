"""One request's phase records (:mod:`extproc.core.phase_records`, each set once) and the facts
read from them: who calls, what for, what was admitted and at what cost, the response's
status.  The base of :class:`extproc.core.session.Session`, which adds the lifecycle, the
figures and the account; nothing here decides."""

from __future__ import annotations

from extproc.core import admission_plan, end_users
from extproc.core.admission_plan import Cost
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.keys import WindowedBucket
from extproc.core.phase_records import (
    Admitted,
    Identified,
    KeyInfo,
    ModelInfo,
    Parsed,
    PhaseError,
    Reported,
    Requested,
    Responding,
    TenantInfo,
)


class SessionRecords:
    """One request's phase records and the facts derived from them."""

    __slots__ = (
        "_admitted",
        "_attempt",
        "_cost",
        "_identified",
        "_parsed",
        "_reported",
        "_requested",
        "_responding",
    )

    def __init__(self) -> None:
        self._requested: Requested | None = None
        self._identified: Identified | None = None
        self._parsed: Parsed | None = None
        self._admitted: Admitted | None = None
        # the model admission is trying the request as, when not the requested one (the
        # plan's fallback): an error on the way is reported under it
        self._attempt: ModelInfo | None = None
        # the request's cost: the admitted one, with the exact input once counted (a request
        # admitted on a bound)
        self._cost: Cost | None = None
        self._responding: Responding | None = None
        self._reported: Reported | None = None

    # -- records -----------------------------------------------------------------------------

    def request(self, rec: Requested) -> None:
        """Request headers: the request's own facts (its id, path and API)."""
        if self._requested is not None:
            raise PhaseError("the request's headers were read twice")
        self._requested = rec

    def identify(self, rec: Identified) -> None:
        """The caller identified (request headers): who calls, the API, the ledger."""
        if self._identified is not None:
            raise PhaseError("the request was identified twice")
        self._identified = rec

    def parse(self, rec: Parsed) -> None:
        """The body parsed, with the model it asks for (the one it is admitted as is the
        admitted record's)."""
        if self._parsed is not None:
            raise PhaseError("the request's body was parsed twice")
        self._parsed = rec

    def attempting(self, model: ModelInfo | None) -> None:
        """Admission tries the request as ``model`` (a fallback; None: the requested one
        again): until it is admitted, the request is reported under it."""
        self._attempt = model

    def respond(self, rec: Responding) -> None:
        """Response headers: status and metering."""
        self._responding = rec

    @property
    def identified(self) -> Identified | None:
        """Set at the request headers."""
        return self._identified

    @property
    def parsed(self) -> Parsed | None:
        """Set at the request body."""
        return self._parsed

    @property
    def admitted(self) -> Admitted | None:
        """Set when admission said yes."""
        return self._admitted

    @property
    def responding(self) -> Responding | None:
        """Set at the response headers."""
        return self._responding

    @property
    def reported(self) -> Reported | None:
        """The upstream's usage, when it gave one."""
        return self._reported

    # -- derived facts -----------------------------------------------------------------------

    @property
    def request_id(self) -> str:
        """Envoy's request id ('' before the headers)."""
        rec = self._identified or self._requested
        return rec.request_id if rec else ""

    @property
    def api(self) -> ApiFormat | None:
        """The request's API (errors speak its shape): the one the caller's path is routed to
        once identified, else the one its path names."""
        rec = self._identified or self._requested
        return rec.api if rec else None

    @property
    def tenant(self) -> TenantInfo | None:
        """The caller's tenant."""
        return self._identified.tenant if self._identified else None

    @property
    def key(self) -> KeyInfo | None:
        """The caller's key."""
        return self._identified.key if self._identified else None

    @property
    def ledger(self) -> str:
        """The request's ledger id in Redis ('' before identification)."""
        return self._identified.ledger if self._identified else ""

    @property
    def plan(self) -> str:
        """The tenant's plan name ('' before identification)."""
        t = self.tenant
        return t.plan if t else ""

    @property
    def model(self) -> ModelInfo | None:
        """The model served (admitted), else the one admission is trying, else the one asked
        for."""
        if self._admitted is not None:
            return self._admitted.model
        if self._attempt is not None:
            return self._attempt
        return self._parsed.model if self._parsed else None

    @property
    def req(self) -> ParsedRequest | None:
        """The parsed request body."""
        return self._parsed.req if self._parsed else None

    @property
    def cost(self) -> Cost | None:
        """The admitted cost, with the exact input once counted (None: not admitted, or
        admitted unmetered)."""
        return self._cost

    @property
    def metered(self) -> bool:
        """Admitted with counters to settle (not refused, not fail-open, not unmetered)."""
        return self.cost is not None

    @property
    def buckets(self) -> tuple[WindowedBucket, ...]:
        """The buckets admission charged."""
        return self._admitted.buckets if self._admitted else ()

    @property
    def slots(self) -> list[str]:
        """The concurrency sets holding this request (freed at settlement)."""
        return [b.key for b in self.buckets if b.kind == "concurrency"]

    @property
    def holds_slots(self) -> bool:
        """Whether the request takes concurrency slots."""
        return any(b.kind == "concurrency" for b in self.buckets)

    @property
    def status(self) -> int | None:
        """The upstream's (or the gateway's) HTTP status, once known."""
        return self._responding.status if self._responding else None

    @property
    def headers_out(self) -> tuple[tuple[str, str], ...]:
        """Headers added to the response (rate limits, fallback, shadow reports)."""
        return self._admitted.headers if self._admitted else ()

    def buckets_at(
        self, prefix: str, now_ms: int, lease_ms: int, model: ModelInfo | None = None
    ) -> list[WindowedBucket]:
        """The request's buckets in the windows containing ``now_ms`` (as ``model``: by
        default the request's)."""
        tenant, key, req = self.tenant, self.key, self.req
        model = model or self.model
        assert tenant is not None and key is not None and model is not None
        model_key = model.name if model.known else (req.model if req else "*")
        return admission_plan.buckets_for(
            prefix=prefix,
            tenant=tenant.slot,
            key_name=key.name,
            model=model_key,
            limits=tenant.limits_for(key.name),
            now_ms=now_ms,
            prices=model.prices,
            lease_ms=lease_ms,
            user=self.end_user,
        )

    @property
    def priority_asked(self) -> str | None:
        """The priority class the request header asks for (None: none)."""
        rec = self._identified
        return rec.priority if rec is not None else None

    @property
    def end_user(self) -> str:
        """The end user the request names ("": none; extproc.core.end_users)."""
        rec, req = self._identified, self.req
        if rec is None:
            return ""
        return end_users.resolve(
            rec.end_user, rec.end_user_body, req.api if req else "", req.body if req else None
        )
