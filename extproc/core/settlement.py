"""Settlement, planned: what a request's counters, bill and logs end at, as one pure function
of what is known of the request when it ends (:func:`settle`).  Sans-IO and without mutation:
the session gathers the facts (:class:`SettleFacts`), takes the plan, and keeps the figures it
decided; the server executes it (the limiter's corrections, the usage record, the logs, the
input audit, the decode-rate sample).

The rule, by case (:class:`Basis`; docs/semantics.md):

* a non-2xx answer charges nothing, input included;
* a plan that does not settle to actual figures is final at admission: settlement only frees
  its concurrency slots;
* a response whose output is known (a stream's usage within bounds when it completed, else
  what was delivered; a JSON body's usage within bounds; for a request abandoned before any
  response, what the upstream could have generated while it ran) is billed its input and
  output figures;
* otherwise (a JSON answer without usage) the reservation stands, its input corrected to the
  exact count (or to the upstream's figure within the range a bound proves).

A figure that needs the exact count of a prompt admitted on an upper bound is never counted
here: :func:`settle` answers :data:`COUNT_FIRST`, and the count (an action of its own, off the
event loop for a large prompt) comes before the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Final, Literal

from extproc.core.account import RequestAccount
from extproc.core.admission_plan import Cost
from extproc.core.apis.base import ParsedRequest
from extproc.core.figures import Figure, abandoned_output, bounded_input, bounded_output
from extproc.core.keys import WindowedBucket
from extproc.core.lifecycle import Ending
from extproc.core.phase_records import Admitted, Reported, StreamEnd
from extproc.core.policies import Billed
from extproc.core.rules import Adjustment, Rates, Usage

#: Endings before any response the gateway could meter: billed by the abandon rule.
ABANDONED: Final = frozenset(
    (Ending.CLIENT_DISCONNECTED, Ending.UPSTREAM_RESET, Ending.SHUTDOWN, Ending.INTERNAL_ERROR)
)


class Basis(Enum):
    """What a settlement bills on."""

    NOTHING = "nothing"  # a non-2xx answer: nothing charged
    FINAL_AT_ADMISSION = "final_at_admission"  # the admission's charge is final
    RESERVATION = "reservation"  # no output figure: the reservation stands
    ACTUAL = "actual"  # the input and output figures


class CountFirst:
    """The plan needs the exact input count of a prompt admitted on a bound: count, then plan."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "COUNT_FIRST"


COUNT_FIRST: Final = CountFirst()


@dataclass(frozen=True, slots=True)
class SettleFacts:
    """What settlement is decided from (every field a value: the plan changes none of them)."""

    ending: Ending
    now_ms: int
    status: int | None  # the upstream's (or the gateway's) HTTP status, when known
    admitted: Admitted  # what admission charged (its cost is not None)
    cost: Cost  # the admitted cost, with the exact input once counted
    counted: int | None  # the exact input count of a prompt admitted on a bound (None: not taken)
    reported: Reported | None  # the upstream's usage
    decided_output: Figure | int | None  # an output figure decided before (the last response)
    stream: StreamEnd | None  # a stream read chunk by chunk, at its end
    req: ParsedRequest | None
    charged: int  # tokens the request's counters hold (its account's total)
    uncounted: bool  # already billed (a figure shown) at the upstream's input without a count
    shortcut: bool  # the model may be admitted on a bound and billed at the upstream's figure
    abandon_rate: int | None = None  # tokens/s per sequence (None: the model's configured rate)
    abandon_start_ms: int = 0  # after admission, when the abandon rule starts counting
    first_chunk_ms: int = 0  # when the response's first body chunk came (0: not read by chunk)


@dataclass(frozen=True, slots=True)
class InputAudit:
    """What the input figure says of the model's upstream (:class:`extproc.core.audits.InputAudits`):
    billed at the upstream's figure without a count, a count that agreed with it, or one that
    disagreed (the shortcut stops)."""

    verdict: Literal["uncounted", "agreed", "disagreed"]
    figure: int  # the input billed
    bound: int  # what admission charged for the input
    disagreed_with: Figure | None = None

    @property
    def check(self) -> str:
        """The usage record's ``input_check``."""
        if self.verdict == "uncounted":
            return "uncounted"
        if self.disagreed_with is not None and self.disagreed_with.disagreement is not None:
            return self.disagreed_with.disagreement
        return ""


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """A completed response's decode speed, for the model's learned rate: ``tokens`` over
    ``decode_ms`` (less the model's learned time to start when ``less_learned_start``), and the
    time to the first chunk (None: not measured)."""

    tokens: int
    sequences: int
    decode_ms: int
    start_ms: int | None
    less_learned_start: bool = False


@dataclass(frozen=True, slots=True)
class SettlementPlan:
    """What settlement does (decided once per request)."""

    ending: Ending
    basis: Basis
    input: int  # input tokens behind the total
    output: int | None  # output tokens (None: not known, the reservation or admission stands)
    usage: Usage  # the usage by kind the counters must hold
    total: int  # tokens the request's counters hold once settled
    corrects: bool  # the counters are corrected to ``usage`` (else they hold what was charged)
    charged: int  # tokens they held before
    holds_slots: bool  # concurrency slots to free
    output_figure: Figure | int | None  # the output figure decided (kept by the session)
    input_figure: Figure | int | None  # the input figure billed, for its disagreement log
    adopt_input: int | None  # the upstream's figure the session takes as its count
    uncounted: bool  # billed at the upstream's input figure without a count
    audit: InputAudit | None
    decode: DecodeSample | None

    @property
    def delta(self) -> int:
        """The correction, in tokens."""
        return self.total - self.charged

    @property
    def calls_limiter(self) -> bool:
        """Whether the limiter is called: counters to correct or slots to free (the call marks
        the ledger settled too, so it is never reclaimed as abandoned)."""
        return self.corrects or self.holds_slots

    def disagreements(self) -> tuple[tuple[str, Figure], ...]:
        """Upstream figures outside their bounds, to count and log (once: at settlement)."""
        if not (self.corrects and self.output is not None and self.total > 0):
            return ()
        out = (("output", self.output_figure), ("input", self.input_figure))
        return tuple(
            (kind, f) for kind, f in out if isinstance(f, Figure) and f.disagreement is not None
        )

    def billed(self, requests: int, prices: Rates | None) -> Billed:
        """The usage record's figures: the input at most what was charged (nothing for a
        request that charged nothing), the output the settled figure or the rest of the
        charge, and the money the prices of the usage billed."""
        inp = min(self.input, max(0, self.total))
        out = self.output if self.output is not None else max(0, self.total - inp)
        money: Decimal | None = None
        if prices is not None:
            billed_usage = self.usage if self.total > 0 else Usage()
            if not self.corrects and self.total > 0:
                billed_usage = Usage(input=inp, output=out, requests=requests)
            money = Decimal(prices.units(billed_usage)).scaleb(-6)
        return Billed(inp, out, money)


# -- figures ---------------------------------------------------------------------------------


def upstream_input(adm: Admitted, counted: int | None, reported: Reported | None) -> int | None:
    """The upstream's input figure, when it stands for a prompt admitted on a bound without a
    count: between the fewest tokens the tokenizer can count for that bound (1 at least) and the
    bound itself, the range the exact count is proven to lie in.  Outside it the figure is
    checked against the exact count, as on the counted path (:func:`bounded_input`)."""
    if reported is None or reported.input is None or adm.cost is None:
        return None
    pending = adm.input_bound and counted is None
    if pending and max(1, adm.input_floor) <= reported.input <= adm.cost.input_tokens:
        return reported.input
    return None


def input_figure(
    adm: Admitted,
    cost: Cost,
    counted: int | None,
    reported: Reported | None,
    req: ParsedRequest | None,
) -> tuple[Figure | int, bool] | CountFirst:
    """Input to charge, and whether it is the upstream's figure taken without a count: that
    figure within its proven range for a prompt admitted on a bound and not counted, else the
    upstream's figure within bounds around the gateway's count, or the count when the upstream
    gave none (or when the count is an estimate: a deliberate over-count stands)."""
    if adm.input_bound and counted is None:
        upstream = upstream_input(adm, counted, reported)
        if upstream is not None:
            return upstream, True
        return COUNT_FIRST
    if reported is None or reported.input is None:
        return cost.input_tokens, False
    model = adm.model
    unseen = bool(req is not None and req.notes.get("unseen_input"))
    if not unseen and not model.exact_count:
        return cost.input_tokens, False
    figure = bounded_input(
        reported.input, cost.input_tokens, unseen=unseen, ceiling=model.max_input_tokens
    )
    return figure, False


def json_output(
    decided: Figure | int | None, reported: Reported | None, cost: Cost
) -> Figure | None:
    """A JSON response's output figure: the upstream's usage within bounds."""
    if isinstance(decided, Figure):
        return decided
    if reported is None or reported.output is None:
        return None
    return bounded_output(reported.output, 0, cost.effective_max_output)


def stream_output(
    decided: Figure | int | None, reported: Reported | None, cost: Cost | None, end: StreamEnd
) -> Figure | int:
    """A stream's output: the upstream's usage within bounds when the stream completed and
    reported one, otherwise the tokens delivered to the client (the one decided first
    stands)."""
    if decided is not None:
        return decided
    if end.complete and not end.cut and reported is not None and reported.output is not None:
        high = cost.effective_max_output if cost else reported.output
        return bounded_output(reported.output, end.counted, high, floor=end.text_events)
    return end.delivered


def asks_abandon_rate(ending: Ending, stream: StreamEnd | None) -> bool:
    """Whether the abandon rule may bill this request (the model's learned rate is asked)."""
    return stream is None and ending in ABANDONED


# -- the plan --------------------------------------------------------------------------------


def settle(f: SettleFacts) -> SettlementPlan | CountFirst:
    """The settlement of a request (pure): :data:`COUNT_FIRST` when a figure needs the exact
    input count that ``f`` does not carry yet."""
    adm, cost = f.admitted, f.cost
    holds_slots = any(b.kind == "concurrency" for b in adm.buckets)
    if f.status is not None and not 200 <= f.status < 300:
        nothing = Usage()
        return _plan(
            f,
            Basis.NOTHING,
            inp=0,
            output=0,
            usage=nothing,
            total=0,
            corrects=True,
            slots=holds_slots,
        )
    if not cost.settle_to_actual:
        out = max(0, f.charged - cost.input_tokens)
        usage = Usage(input=cost.input_tokens, output=out)
        # settlement only frees the concurrency slots
        basis = Basis.FINAL_AT_ADMISSION
        total = f.charged
        return _plan(
            f,
            basis,
            inp=cost.input_tokens,
            output=None,
            usage=usage,
            total=total,
            corrects=False,
            slots=holds_slots,
        )
    decided = f.decided_output
    output: int | None
    if f.stream is not None:
        decided = stream_output(decided, f.reported, cost, f.stream)
        output = decided.value if isinstance(decided, Figure) else decided
    elif (fig := json_output(decided, f.reported, cost)) is not None:
        decided, output = fig, fig.value
    elif f.ending in ABANDONED:
        req = f.req
        rate = adm.model.abandoned_tokens_per_second if f.abandon_rate is None else f.abandon_rate
        elapsed = f.now_ms - adm.at_ms - f.abandon_start_ms
        output = abandoned_output(cost, req.sequences if req else 1, elapsed, rate)
    else:
        output = None
    if output is None:
        return _reservation(f, holds_slots, decided)
    got = input_figure(adm, cost, f.counted, f.reported, f.req)
    if isinstance(got, CountFirst):
        return got
    figure, uncounted = got
    inp = figure.value if isinstance(figure, Figure) else figure
    rep = f.reported
    usage = Usage(
        input=inp,
        output=output,
        cached_input=min(rep.cached_input, inp) if rep else 0,
        reasoning=min(rep.reasoning, output) if rep else 0,
        requests=cost.requests,
    )
    return _plan(
        f,
        Basis.ACTUAL,
        inp=inp,
        output=output,
        usage=usage,
        total=inp + output,
        corrects=True,
        slots=holds_slots,
        output_figure=decided,
        input_fig=figure,
        uncounted=f.uncounted or uncounted,
    )


def _reservation(
    f: SettleFacts, holds_slots: bool, decided: Figure | int | None
) -> SettlementPlan | CountFirst:
    """No output figure: the reservation stands; an input admitted on a bound is corrected to
    the upstream's figure within its proven range, else to its count."""
    adm = f.admitted
    assert adm.cost is not None
    adopt = upstream_input(adm, f.counted, f.reported)
    if adm.input_bound and f.counted is None and adopt is None:
        return COUNT_FIRST
    exact = adopt if adopt is not None else f.cost.input_tokens
    charged_in = adm.cost.input_tokens  # what admission charged for the input
    out = max(0, f.charged - charged_in)
    usage = Usage(input=exact, output=out, requests=f.cost.requests)
    corrects = charged_in != exact
    return _plan(
        f,
        Basis.RESERVATION,
        inp=exact,
        output=None,
        usage=usage,
        total=exact + out if corrects else f.charged,
        corrects=corrects,
        slots=holds_slots,
        output_figure=decided,
        adopt=adopt,
        uncounted=f.uncounted or adopt is not None,
    )


def _plan(
    f: SettleFacts,
    basis: Basis,
    *,
    inp: int,
    output: int | None,
    usage: Usage,
    total: int,
    corrects: bool,
    slots: bool,
    output_figure: Figure | int | None = None,
    input_fig: Figure | int | None = None,
    adopt: int | None = None,
    uncounted: bool | None = None,
) -> SettlementPlan:
    uncounted = f.uncounted if uncounted is None else uncounted
    adm = f.admitted
    # the model keeps its shortcut unless a count contradicts its upstream's figure
    shortcut = f.shortcut or (adm.input_bound and (f.counted is not None or adopt is not None))
    audit: InputAudit | None = None
    if corrects and output is not None and total > 0:
        if shortcut and input_fig is not None:
            audit = _audit(uncounted, input_fig, adm)
    elif uncounted and shortcut:
        audit = _audit(uncounted, inp, adm)  # an abandoned request, at the engine's figure
    decode: DecodeSample | None = None
    req = f.req
    if f.ending is Ending.COMPLETED and output is not None and req is not None:
        if f.first_chunk_ms > 0:
            # read chunk by chunk: the decode rate (first chunk to end) and the time to start
            # (admission to first chunk)
            decode = DecodeSample(
                output, req.sequences, f.now_ms - f.first_chunk_ms, f.first_chunk_ms - adm.at_ms
            )
        elif f.stream is None:
            # a JSON response: admission to end, less the model's learned time to start
            decode = DecodeSample(output, req.sequences, f.now_ms - adm.at_ms, None, True)
    return SettlementPlan(
        ending=f.ending,
        basis=basis,
        input=inp,
        output=output,
        usage=usage,
        total=total,
        corrects=corrects,
        charged=f.charged,
        holds_slots=slots,
        output_figure=output_figure,
        input_figure=input_fig,
        adopt_input=adopt,
        uncounted=uncounted,
        audit=audit,
        decode=decode,
    )


def _audit(uncounted: bool, inp: Figure | int, adm: Admitted) -> InputAudit | None:
    """What the input figure says of the model's upstream (a model with the shortcut)."""
    value = inp.value if isinstance(inp, Figure) else inp
    if uncounted:
        bound = adm.cost.input_tokens if adm.cost is not None else value
        return InputAudit("uncounted", value, bound)
    if not isinstance(inp, Figure):
        return None
    bound = adm.cost.input_tokens if adm.cost is not None else value
    if inp.disagreement is None:
        return InputAudit("agreed", value, bound)
    return InputAudit("disagreed", value, bound, inp)


def corrections(
    plan: SettlementPlan, account: RequestAccount, current: list[WindowedBucket]
) -> list[Adjustment]:
    """Corrections that make every per-token counter hold the plan's usage (none when the
    counters keep what was charged)."""
    if not plan.corrects:
        return []
    return account.adjustments(plan.usage, current)
