"""One request as a sans-IO session: typed, immutable phase records and the decisions that read
them.

A request moves through phases (the transition table of :mod:`extproc.core.lifecycle`); each
phase leaves one frozen record, set once, so which fact is valid when is visible in the types:

==============  ======================================================================
record          holds
==============  ======================================================================
``Identified``  request id, path, API, the caller (key, tenant), the ledger id
``Parsed``      the parsed body and the model it is counted as (the requested one)
``Admitted``    the model served, the cost (None: admitted unmetered), buckets, time,
                the headers to add to the response
``Responding``  the upstream's status and how the response is metered
``Reported``    what the upstream said it used (a JSON body's or a stream's ``usage``)
``Settlement``  the final figures: ending, total to charge, input, output, usage
==============  ======================================================================

Besides the records the session keeps two accumulators of limiter answers, changed only by its
own methods: the :class:`RequestAccount` (what each counter was charged) and the last stream
charge whose answer never came.

Every per-request decision is a function here, fed with the records and the clock reading the
caller passes in: how a response is metered (:func:`classify`), which upstream figures are
trusted (:func:`bounded_output`, :func:`bounded_input`), what an abandoned request could have
generated (:func:`abandoned_output`), what settlement charges (:meth:`Session.settlement`), the
plan's fallback model (:func:`fallback_for`) and the shadow-limit report (:func:`shadow_outcome`).
The server layer executes what they decide and holds no policy of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from extproc.core import admission
from extproc.core.account import RequestAccount
from extproc.core.admission import Cost
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.chunks import Usage as UpstreamUsage
from extproc.core.encoding import UnsupportedEncoding, decoder_for, is_json, media_type
from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import Closed, Ending, Lifecycle, State
from extproc.core.rules import RATE_SCALE, Adjustment, Limit, Rates, UnconfirmedCharge, Usage

# -- what the session needs to know of the configuration (structural: core imports no config) --


class ModelInfo(Protocol):
    """A metered model, as far as one request's decisions need it."""

    @property
    def name(self) -> str: ...
    @property
    def known(self) -> bool: ...
    @property
    def prices(self) -> Rates | None: ...
    @property
    def currency(self) -> str: ...
    @property
    def max_input_tokens(self) -> int | None: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def exact_count(self) -> bool: ...
    @property
    def continuous_usage(self) -> bool: ...
    @property
    def abandoned_tokens_per_second(self) -> int: ...
    def stream_counter(self) -> Callable[[str], int]: ...


class TenantInfo(Protocol):
    """A tenant with its resolved limits."""

    @property
    def id(self) -> str: ...
    @property
    def plan(self) -> str: ...
    @property
    def limits(self) -> tuple[Limit, ...]: ...


class KeyInfo(Protocol):
    """An API key's name (safe to log)."""

    @property
    def name(self) -> str: ...


# -- the phase records -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identified:
    """Request headers read: who calls, on which path and API."""

    request_id: str
    path: str = ""
    api: ApiFormat | None = None
    key: KeyInfo | None = None
    tenant: TenantInfo | None = None
    ledger: str = ""


@dataclass(frozen=True, slots=True)
class Parsed:
    """The request body parsed, and the model it asked for (or the unknown-model stand-in)."""

    req: ParsedRequest
    model: ModelInfo


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admission said yes. ``cost`` is None when Redis was down and the plan let the request
    through unmetered (fail-open): nothing to charge, settle or meter."""

    model: ModelInfo
    cost: Cost | None
    buckets: tuple[WindowedBucket, ...] = ()
    at_ms: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    # admitted on an upper bound of the input (``cost.input_tokens``); the exact count comes
    # later (:meth:`Session.input_counted`) and replaces it before any figure is decided
    input_bound: bool = False
    # the fewest tokens the tokenizer can count for that bound (every token stands for at
    # most its vocabulary's longest token in bytes): an upstream figure the counted path would
    # refuse for any count from here to the bound is checked against the count
    input_floor: int = 0
    # what admission charged for the input, once a count replaced the bound (-1: the count)
    charged_input: int = -1


MeteringKind = Literal[
    "local_reply", "unmetered", "upstream_error", "unmeterable", "stream", "read_json", "done"
]


@dataclass(frozen=True, slots=True)
class Metering:
    """How a response is handled: ``kind``, the body's decoder, why it cannot be metered."""

    kind: MeteringKind
    decoder: Any = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Responding:
    """Response headers read: the upstream's status and how the body is metered."""

    status: int
    metering: Metering


@dataclass(frozen=True, slots=True)
class Reported:
    """What the upstream said it used (``output`` includes reasoning, ``input`` cached input)."""

    input: int | None
    output: int | None
    cached_input: int = 0
    reasoning: int = 0

    @classmethod
    def of(cls, usage: UpstreamUsage) -> Reported:
        """The record of a JSON body's or a stream's parsed ``usage``."""
        return cls(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_input_tokens,
            usage.reasoning_tokens,
        )


@dataclass(frozen=True, slots=True)
class Figure:
    """A trusted figure, and the disagreement (``low``/``high``) when the reported one was
    outside its bounds (``bound`` is then what is charged instead)."""

    value: int
    reported: int
    counted: int
    disagreement: Literal["low", "high"] | None = None
    bound: int = 0


@dataclass(frozen=True, slots=True)
class Settlement:
    """What settlement does: ``total`` TPM tokens to hold (None: the admission charge is final),
    the input and output tokens behind it, and the usage by kind."""

    ending: Ending
    total: int | None
    input: int
    output: int | None
    usage: Usage


# -- trusted figures -------------------------------------------------------------------------

#: A stream's reported output may be below the gateway's recount by this share plus the slack:
#: recounting each delta on its own finds more tokens than the engine generated (a delta is
#: one token whose text may re-tokenise as two). Measured against a real vLLM (docs/
#: engine-tests.md): +7-10 % on natural text from a real model, up to +26 % on a small random
#: model's free output; the events that carried text are a floor no report may go below.
OUTPUT_TOLERANCE = 0.30
OUTPUT_SLACK_TOKENS = 8
#: The upstream's input figure is trusted within this share (plus the slack) around the
#: gateway's count: the model's chat template frames messages differently from the OpenAI
#: formula the gateway falls back to (a few tokens per message either way).
INPUT_TOLERANCE = 0.25
INPUT_SLACK_TOKENS = 16
#: A chat template may add a default system prompt the gateway cannot see; above the count by
#: more than this (plus the tolerance) the figure is not trusted.
INPUT_TEMPLATE_ALLOWANCE = 64
#: Server-side state can add at most this much unseen input when the model sets no limit.
UNSEEN_INPUT_CEILING = 1_000_000
#: What an upstream generates per second per sequence, for requests abandoned before their
#: response: the default of a model's ``abandoned_tokens_per_second``.  A real engine (vLLM)
#: aborts a non-stream when Envoy resets it for a client that left, having generated for as
#: long as it ran (docs/engine-tests.md): the bill follows the time, not the reservation.
ABANDONED_TOKENS_PER_SECOND = 200


def bounded_output(reported: int, counted: int, high: int, *, floor: int = 0) -> Figure:
    """The upstream's output figure, trusted within ``[counted - tolerance, high]`` and never
    below ``floor`` (tokens known to have passed: one per event that carried text); outside,
    the nearest bound is charged (an upstream reporting nothing still pays what passed)."""
    low = max(0, floor, math.floor(counted * (1 - OUTPUT_TOLERANCE)) - OUTPUT_SLACK_TOKENS)
    low = min(low, high)
    if reported < low:
        return Figure(low, reported, counted, "low", low)
    if reported > high:
        return Figure(high, reported, counted, "high", high)
    return Figure(reported, reported, counted)


def run_ahead_budget(
    budget: int,
    *,
    buckets: tuple[WindowedBucket, ...],
    values: tuple[int, ...],
    cost: Cost,
    sequences: int,
) -> int:
    """The per-sequence output budget to forward so the engine cannot run far past the quota.

    An engine keeps generating while nobody reads its stream (measured: vLLM's generation
    counter went on at full speed behind a stalled reader), so a processor that lags cannot
    stop it by pausing; only a reset or the forwarded budget can. A stream is cut once its
    tenant's tightest per-token bucket is used up (lazy: within about one batch of N), so the
    upstream need never be allowed more than that room plus two batches: the client still sees
    the quota cut first, and what the engine computes beyond it is bounded."""
    if not cost.meter_stream or not cost.enforce_stream:
        return budget
    rooms = [
        (b.limit.limit - v) * RATE_SCALE // b.rates.output
        for b, v in zip(buckets, values, strict=True)
        if b.kind == "tpm" and not b.limit.shadow and b.rates.output > 0
    ]
    if not rooms:
        return budget
    room = max(0, min(rooms)) + cost.reserved_output + 2 * cost.every
    per_sequence = -(-room // max(1, sequences))
    return max(1, min(budget, per_sequence))


def bounded_input(reported: int, counted: int, *, unseen: bool, ceiling: int | None) -> Figure:
    """The upstream's input figure (``prompt_tokens``/``input_tokens``) within bounds around the
    gateway's own count; a request carrying server-side state the gateway cannot see
    (``previous_response_id``) may be charged the upstream's larger figure up to the model's
    input limit."""
    low = max(0, math.floor(counted * (1 - INPUT_TOLERANCE)) - INPUT_SLACK_TOKENS)
    if unseen:
        high = ceiling or UNSEEN_INPUT_CEILING
        high = max(high, counted)
    else:
        high = math.ceil(counted * (1 + INPUT_TOLERANCE)) + INPUT_TEMPLATE_ALLOWANCE
    if reported < low:
        return Figure(low, reported, counted, "low", low)
    if reported > high:
        return Figure(high, reported, counted, "high", high)
    return Figure(reported, reported, counted)


def abandoned_output(
    cost: Cost, sequences: int, elapsed_ms: int, rate: int = ABANDONED_TOKENS_PER_SECOND
) -> int:
    """Output an upstream could have generated for a request abandoned ``elapsed_ms`` after
    its admission, before its response, at ``rate`` tokens per second per sequence (rounded
    up): never more than was reserved."""
    per_second = max(0, rate) * max(1, sequences)
    return min(cost.reserved_output, -(-max(0, elapsed_ms) * per_second // 1000))


# Media types that are streams but not SSE: the meter cannot read them.
UNMETERABLE_STREAMS = ("application/x-ndjson", "application/jsonl", "application/json-seq")


def parse_status(headers: dict[str, str]) -> int:
    """The ``:status`` pseudo-header as a number (0 when it is missing or not a number)."""
    try:
        return int(headers.get(":status", "0"))
    except ValueError:
        return 0


def classify(
    headers: dict[str, str],
    before: State,
    *,
    parsed: Parsed | None,
    admitted: Admitted | None,
    api: ApiFormat | None,
    end_of_stream: bool,
) -> Metering:
    """How a response is metered, from its status and headers and the request's phase."""
    status = parse_status(headers)
    if before in (State.AWAIT_HEADERS, State.AWAIT_BODY):
        return Metering("local_reply")
    cost = admitted.cost if admitted is not None else None
    if cost is None or parsed is None or api is None:
        return Metering("unmetered")
    if not 200 <= status < 300:
        return Metering("upstream_error")
    ctype = headers.get("content-type", "")
    try:
        decoder = decoder_for(headers.get("content-encoding", ""))
    except UnsupportedEncoding:
        return Metering(
            "unmeterable", reason=f"content-encoding {headers.get('content-encoding', '')[:40]}"
        )
    if parsed.req.stream and api.can_stream and cost.meter_stream and not is_json(ctype):
        if media_type(ctype) in UNMETERABLE_STREAMS:
            return Metering("unmeterable", reason=f"content-type {media_type(ctype)}")
        return Metering("stream", decoder)
    if cost.settle_to_actual and not end_of_stream:
        return Metering("read_json", decoder)
    return Metering("done")


# -- policies beside the limits --------------------------------------------------------------


def fallback_for(
    fallbacks: dict[str, dict[str, str]],
    *,
    tenant: TenantInfo,
    model: ModelInfo,
    buckets: tuple[WindowedBucket, ...],
    values: tuple[int, ...],
    cost: Cost,
) -> str | None:
    """The plan's fallback model for a refused request, when what refused it was a limit on
    the requested model (a tenant-wide limit would refuse the fallback too)."""
    name = fallbacks.get(tenant.plan, {}).get(model.name)
    if name is None or not model.known:
        return None
    on_model = any(
        b.limit.model == model.name
        and not b.limit.shadow
        and admission.would_refuse(b, v, admission.admission_amount(b, cost))
        for b, v in zip(buckets, values, strict=True)
    )
    return name if on_model else None


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """Each limit kind's decision at admission (``(metric, decision)`` to count) and the shadow
    limits that would have refused the request."""

    decisions: tuple[tuple[str, str], ...]
    exceeded: tuple[str, ...]

    def headers(self) -> tuple[tuple[str, str], ...]:
        """``x-ratelimit-shadow-exceeded`` naming the shadow limits that would have refused."""
        if not self.exceeded:
            return ()
        return (("x-ratelimit-shadow-exceeded", "; ".join(self.exceeded)),)


def shadow_outcome(
    buckets: tuple[WindowedBucket, ...], values: tuple[int, ...], cost: Cost
) -> ShadowOutcome:
    """Shadow limits are counted and reported, never enforced: which would have refused."""
    kinds: set[str] = set()
    decisions: list[tuple[str, str]] = []
    exceeded: list[str] = []
    for b, v in zip(buckets, values, strict=True):
        if not b.limit.shadow:
            kinds.add(b.metric)
            continue
        # values are after charging: over the limit means this admission would have been refused
        if v > b.limit.limit and admission.admission_amount(b, cost) > 0:
            exceeded.append(admission.describe(b.limit))
            decisions.append((b.metric, "shadow_refused"))
        else:
            decisions.append((b.metric, "shadow_allowed"))
    decisions += [(kind, "allowed") for kind in sorted(kinds)]
    return ShadowOutcome(tuple(decisions), tuple(exceeded))


# -- the session -----------------------------------------------------------------------------


class PhaseError(RuntimeError):
    """A phase record set twice, or read before its phase."""


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """What the stream meter knows when settlement (or the last response) needs a figure:
    tokens counted, delivered, whether the API's terminal event passed and whether the gateway
    cut the stream."""

    counted: int
    delivered: int
    complete: bool
    cut: bool
    text_events: int = 0


class Session:
    """One request: its lifecycle, its phase records (each set once) and its account."""

    __slots__ = (
        "_admitted",
        "_count",
        "_count_inline",
        "_identified",
        "_output",
        "_parsed",
        "_reported",
        "_responding",
        "_settlement",
        "account",
        "count_failed",
        "life",
        "unconfirmed",
    )

    def __init__(self) -> None:
        self.life = Lifecycle()
        self._identified: Identified | None = None
        self._parsed: Parsed | None = None
        self._admitted: Admitted | None = None
        self._responding: Responding | None = None
        self._reported: Reported | None = None
        self._output: Figure | int | None = None
        self._settlement: Settlement | None = None
        # the exact input count of a request admitted on a bound, taken when a figure needs it
        self._count: Callable[[], int] | None = None
        self._count_inline = True
        self.count_failed = False
        self.account = RequestAccount()
        # the last stream charge whose answer never came (settlement undoes it if it ran)
        self.unconfirmed: UnconfirmedCharge | None = None

    # -- records -----------------------------------------------------------------------------

    def identify(self, rec: Identified) -> None:
        """Request headers: the caller and the API."""
        if self._identified is not None and self._identified.tenant is not None:
            raise PhaseError("the request was identified twice")
        self._identified = rec

    def parse(self, rec: Parsed) -> None:
        """The body parsed (a fallback model replaces the model it is counted as)."""
        self._parsed = rec

    def admit(self, rec: Admitted, usage: Usage | None = None) -> None:
        """Admission said yes; ``usage`` is what it charged (None: nothing, fail-open)."""
        if self._admitted is not None:
            raise PhaseError("the request was admitted twice")
        self._admitted = rec
        if usage is not None:
            self.account.record(list(rec.buckets), usage)

    def count_input_with(self, count: Callable[[], int], *, inline: bool = True) -> None:
        """How to count the input exactly, for a request admitted on an upper bound: called at
        most once, only when a figure needs the count (:meth:`needs_count`).  A prompt too
        large to count on the event loop (``inline`` False) is never counted here: the server
        counts it in a worker thread (:meth:`input_counted`) before it asks for a figure."""
        self._count = count
        self._count_inline = inline

    def input_counted(self, exact: int) -> None:
        """The exact input count of a request admitted on an upper bound: it replaces the bound
        in the cost, so every later figure (cut messages, settlement, records) uses it; what
        admission charged stays in the account, so settlement refunds the difference."""
        rec = self._admitted
        if rec is None or not rec.input_bound or rec.cost is None:
            raise PhaseError("an exact input count for a request not admitted on a bound")
        if self._settlement is not None:
            raise PhaseError("the input count arrived after settlement was decided")
        self._admitted = replace(
            rec,
            cost=replace(rec.cost, input_tokens=exact),
            input_bound=False,
            charged_input=rec.cost.input_tokens,
        )

    @property
    def counted_after_bound(self) -> bool:
        """Admitted on a bound, and the exact count has replaced it since."""
        rec = self._admitted
        return rec is not None and not rec.input_bound and rec.charged_input >= 0

    @property
    def input_pending(self) -> bool:
        """Admitted on a bound whose exact count has not been taken."""
        rec = self._admitted
        return rec is not None and rec.input_bound

    def _upstream_input(self) -> int | None:
        """The upstream's input figure, when it stands for a request admitted on a bound without
        a count: between the fewest tokens the tokenizer can count for that bound (1 at
        least) and the bound itself, the range the exact count is proven to lie in.  Outside
        it the figure is checked against the exact count, as on the counted path
        (:func:`bounded_input`).  An upstream whose figures a count contradicted loses this
        shortcut: the server counts its requests (:class:`extproc.core.audits.InputAudits`)."""
        rep, adm = self._reported, self._admitted
        if rep is None or rep.input is None or adm is None or adm.cost is None:
            return None
        if adm.input_bound and max(1, adm.input_floor) <= rep.input <= adm.cost.input_tokens:
            return rep.input
        return None

    def needs_count(self) -> bool:
        """Whether a figure (settlement, a cut's message, the access log's input) would take
        the exact count now: the server takes it first, off the event loop for a large
        prompt."""
        return self.input_pending and self._upstream_input() is None

    def _exact_input(self) -> None:
        """Take the exact count of a request admitted on a bound.  A count that fails (it
        cannot for a body the bound walk accepted) leaves the bound: an over-count."""
        if not self.input_pending:
            return
        cost = self.cost
        assert cost is not None
        exact = cost.input_tokens
        if self._count is not None and self._count_inline:
            try:
                exact = self._count()
            except Exception:
                self.count_failed = True
        elif self._count is not None:
            # the server should have counted it off the loop first: never stall the loop, and
            # keep the bound (an over-count, logged at settlement)
            self.count_failed = True
        self._count = None
        self.input_counted(exact)

    def respond(self, rec: Responding) -> None:
        """Response headers: status and metering."""
        self._responding = rec

    def report(self, rec: Reported) -> None:
        """The upstream's usage (a stream may report more than once: the last one stands)."""
        if self._output is not None:
            return  # the figures are decided: a late report changes nothing
        self._reported = rec

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
        return self._identified.request_id if self._identified else ""

    @property
    def api(self) -> ApiFormat | None:
        """The request's API (errors speak its shape)."""
        return self._identified.api if self._identified else None

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
        """The model served (admitted), else the one asked for."""
        if self._admitted is not None:
            return self._admitted.model
        return self._parsed.model if self._parsed else None

    @property
    def req(self) -> ParsedRequest | None:
        """The parsed request body."""
        return self._parsed.req if self._parsed else None

    @property
    def cost(self) -> Cost | None:
        """The admitted cost (None: not admitted, or admitted unmetered)."""
        return self._admitted.cost if self._admitted else None

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

    # -- decisions ---------------------------------------------------------------------------

    def buckets_at(self, prefix: str, now_ms: int, lease_ms: int) -> list[WindowedBucket]:
        """The request's buckets in the windows containing ``now_ms``."""
        tenant, key, model, req = self.tenant, self.key, self.model, self.req
        assert tenant is not None and key is not None and model is not None
        model_key = model.name if model.known else (req.model if req else "*")
        return admission.buckets_for(
            prefix=prefix,
            tenant=tenant.id,
            key_name=key.name,
            model=model_key,
            limits=tenant.limits,
            now_ms=now_ms,
            prices=model.prices,
            lease_ms=lease_ms,
        )

    def json_output(self) -> Figure | None:
        """A JSON response's output figure: the upstream's usage within bounds (decided once)."""
        if isinstance(self._output, Figure):
            return self._output
        rep, cost = self._reported, self.cost
        if rep is None or rep.output is None or cost is None:
            return None
        self._output = bounded_output(rep.output, 0, cost.effective_max_output)
        return self._output

    def stream_output(self, end: StreamEnd) -> Figure | int:
        """A stream's output, decided once it is final: the upstream's usage within bounds when
        the stream completed and reported one, otherwise the tokens delivered to the client.

        Called for the last response's metadata and again at settlement: the second call
        returns the first answer, so a disagreement is logged and counted once."""
        if self._output is not None:
            return self._output
        rep, cost = self._reported, self.cost
        if end.complete and not end.cut and rep is not None and rep.output is not None:
            high = cost.effective_max_output if cost else rep.output
            out: Figure | int = bounded_output(rep.output, end.counted, high, floor=end.text_events)
        else:
            out = end.delivered
        self._output = out
        return out

    @property
    def output_decided(self) -> int | None:
        """The output figure, once decided."""
        out = self._output
        if out is None:
            return None
        return out.value if isinstance(out, Figure) else out

    def input_figure(self) -> Figure | int:
        """Input to charge: the upstream's figure within bounds around the gateway's count, or
        the gateway's count when the upstream gave none."""
        if self.input_pending:
            upstream = self._upstream_input()
            if upstream is not None:
                return upstream  # the engine's own count, under a proven bound
            self._exact_input()
        cost, req, model, rep = self.cost, self.req, self.model, self._reported
        assert cost is not None
        if rep is None or rep.input is None:
            return cost.input_tokens
        unseen = bool(req is not None and req.notes.get("unseen_input"))
        if not unseen and (model is None or not model.exact_count):
            return cost.input_tokens  # an estimate is a deliberate over-count: it stands
        ceiling = model.max_input_tokens if model else None
        return bounded_input(rep.input, cost.input_tokens, unseen=unseen, ceiling=ceiling)

    def input_tokens(self) -> int:
        """The input figure as a number."""
        got = self.input_figure()
        return got.value if isinstance(got, Figure) else got

    def close(self, how: Closed, *, stream_complete: bool = False) -> Ending:
        """The gRPC stream closed. A stream whose terminal event reached the client completed,
        whoever closed first; one closed before its end was abandoned by the client (Envoy
        closes the processor's stream the same way for a client that leaves and an upstream
        that resets: the client leaving is by far the common cause, and an upstream reset is
        named by the client's own error, not by the bill)."""
        if stream_complete:
            self.life.name_ending(Ending.COMPLETED)
        return self.life.close(how)

    def settlement(
        self, now_ms: int, *, stream: StreamEnd | None = None, ending: Ending | None = None
    ) -> Settlement:
        """The request's final figures (decided once): what the counters must hold, by kind."""
        if self._settlement is not None:
            return self._settlement
        cost = self.cost
        assert cost is not None
        ending = ending or self.life.ending or Ending.COMPLETED
        status = self.status
        if status is not None and not 200 <= status < 300:
            result = Settlement(ending, 0, 0, 0, Usage())
        elif not cost.settle_to_actual:
            # final at admission; settlement only frees concurrency slots
            total = self.account.total
            out = max(0, total - cost.input_tokens)
            result = Settlement(
                ending, None, cost.input_tokens, None, Usage(input=cost.input_tokens, output=out)
            )
        else:
            output: int | None
            if stream is not None:
                got = self.stream_output(stream)
                output = got.value if isinstance(got, Figure) else got
            elif (fig := self.json_output()) is not None:
                output = fig.value
            elif ending in (
                Ending.CLIENT_DISCONNECTED,
                Ending.UPSTREAM_RESET,
                Ending.SHUTDOWN,
                Ending.INTERNAL_ERROR,
            ):
                adm = self._admitted
                assert adm is not None
                req = self.req
                output = abandoned_output(
                    cost,
                    req.sequences if req else 1,
                    now_ms - adm.at_ms,
                    adm.model.abandoned_tokens_per_second,
                )
            else:
                output = None  # a JSON response without usage: the reservation stands
            if output is None:
                # the reservation stands; an input admitted on a bound is corrected to the
                # upstream's figure within its proven range, else to its count
                upstream = self._upstream_input() if self.input_pending else None
                if upstream is not None:
                    self.input_counted(upstream)
                self._exact_input()
                adm = self._admitted
                assert adm is not None and adm.cost is not None
                cost = adm.cost
                charged_in = cost.input_tokens if adm.charged_input < 0 else adm.charged_input
                out = max(0, self.account.total - charged_in)
                result = Settlement(
                    ending,
                    None if charged_in == cost.input_tokens else cost.input_tokens + out,
                    cost.input_tokens,
                    None,
                    Usage(input=cost.input_tokens, output=out, requests=cost.requests),
                )
            else:
                inp = self.input_tokens()
                result = Settlement(ending, inp + output, inp, output, self._usage(inp, output))
        self._settlement = result
        return result

    def _usage(self, inp: int, out: int) -> Usage:
        """Tokens by kind (cached input and reasoning from the upstream's usage, within the
        totals)."""
        rep, cost = self._reported, self.cost
        return Usage(
            input=inp,
            output=out,
            cached_input=min(rep.cached_input, inp) if rep else 0,
            reasoning=min(rep.reasoning, out) if rep else 0,
            requests=cost.requests if cost else 1,
        )

    def adjustments(self, result: Settlement, current: list[WindowedBucket]) -> list[Adjustment]:
        """Corrections that make every per-token counter hold the settlement's units."""
        if result.total is None:
            return []
        return self.account.adjustments(result.usage, current)

    def pending_units(self, bucket: WindowedBucket, delivered: int) -> int:
        """Units settlement would still add to ``bucket`` if the stream ended now with
        ``delivered`` output tokens (what a cut message must add to the counter's value)."""
        cost = self.cost
        if cost is None or not bucket.limit.counts_tokens:
            return 0
        # the input as settlement will take it (the upstream's figure in range, or the count)
        final = Usage(input=self.input_tokens(), output=delivered, requests=cost.requests)
        return bucket.rates.units(final) - self.account.charged(bucket.limit)
