"""Unit tests for the sans-IO request session (extproc.core.session): trusted figures and their
bounds, decisions made once, settlement arithmetic, and the ending of a stream whose terminal
event reached the client."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import load_config_text
from extproc.config.runtime import Model, RuntimeConfig
from extproc.core import admission_plan
from extproc.core.admission_plan import Cost
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.apis.openai import CHAT
from extproc.core.figures import ABANDONED_TOKENS_PER_SECOND, Figure, bounded_input, bounded_output
from extproc.core.lifecycle import Closed, Ending, Input, LifecycleError, State
from extproc.core.phase_records import (
    Admitted,
    Identified,
    Metering,
    Parsed,
    PhaseError,
    Reported,
    Requested,
    Responding,
    StreamEnd,
)
from extproc.core.rules import Charging, Usage
from extproc.core.session import Session

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000}
  est: {tokenizer: {kind: estimate, chars_per_token: 3, safety_factor: 1.25}, max_output_tokens: 1000}
  fast: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000, abandoned_tokens_per_second: 1500}
  idle: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 1000, abandoned_tokens_per_second: 0}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: 100000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def config() -> RuntimeConfig:
    """The rules above, compiled."""
    return load_config_text(RULES)


def admitted_session(
    *,
    model: str = "m",
    stream: bool = True,
    input_tokens: int = 20,
    strict: bool = False,
    api: ApiFormat | None = None,
) -> Session:
    """A session admitted for tenant t on ``model`` with a 500-token output budget."""
    cfg = config()
    tenant = cfg.tenants["t"]
    key = next(iter(cfg.keys_by_digest.values()))
    m: Model = cfg.models[model]
    s = Session()
    s.life.advance(Input.REQUEST_HEADERS)
    s.identify(Identified("r1", "/v1/chat/completions", api, key, tenant, "ledger-1"))
    req = ParsedRequest(
        api="chat", model=model, stream=stream, sequences=1, declared_max_output=500, body={}
    )
    s.parse(Parsed(req, m))
    plan = admission_plan.plan_admission(
        declared_max_output=500,
        sequences=1,
        stream=stream,
        input_tokens=input_tokens,
        model_name=model,
        model_cap=1000,
        max_input_tokens=None,
        over_cap="clamp",
        budget_param="max_tokens",
        charging=Charging(streaming="strict" if strict else "lazy"),
    )
    buckets = tuple(s.buckets_at("aiq", 0, 15_000))
    s.admit(Admitted(m, plan.cost, buckets, 0, ()), admission_plan.admission_usage(plan.cost))
    s.life.advance(Input.REQUEST_BODY)
    s.life.advance(Input.ADMITTED)
    return s


@given(reported=st.integers(0, 10_000), counted=st.integers(0, 10_000), high=st.integers(0, 10_000))
def test_bounded_output_stays_within_bounds(reported: int, counted: int, high: int) -> None:
    """The charged output is the report when within bounds, else the nearest bound."""
    got = bounded_output(reported, counted, high)
    if got.disagreement is None:
        assert got.value == reported
    elif got.disagreement == "low":
        assert reported < got.value == got.bound
    else:
        assert reported > got.value == got.bound == high


def test_output_below_its_bound_is_charged_the_bound_not_the_recount() -> None:
    """vLLM's 300 against a recount of 322 is within the tolerance; a report of 5 is not, and
    what is charged is the documented lower bound, not the recount."""
    assert bounded_output(300, 322, 1000) == Figure(300, 300, 322)
    low = bounded_output(5, 322, 1000)
    assert low.disagreement == "low" and low.value == low.bound < 322


@given(reported=st.integers(0, 5_000), counted=st.integers(0, 5_000))
def test_bounded_input_trusts_the_engine_near_the_count(reported: int, counted: int) -> None:
    """The upstream's prompt figure is trusted near the gateway's count, clamped elsewhere."""
    got = bounded_input(reported, counted, unseen=False, ceiling=None)
    assert got.value == reported or got.disagreement is not None
    assert got.value <= max(reported, counted * 2 + 64)
    if got.disagreement == "low":  # a figure below its bounds is not believed
        assert got.value == got.bound == counted > reported


def test_an_input_figure_below_its_bounds_is_billed_the_count() -> None:
    """An upstream reporting 4 % of an 8,701-token prompt is billed the gateway's count, not
    the low bound (which would leave a quarter of every such prompt unbilled); a figure
    within the bounds is billed as reported."""
    low = bounded_input(348, 8701, unseen=False, ceiling=None)
    assert (low.value, low.disagreement, low.reported) == (8701, "low", 348)
    assert bounded_input(8000, 8701, unseen=False, ceiling=None) == Figure(8000, 8000, 8701)
    s = admitted_session(input_tokens=8701)
    s.respond(Responding(200, Metering("stream")))
    s.report(Reported(348, 40))
    result = s.settlement(0, stream=StreamEnd(counted=41, delivered=41, complete=True, cut=False))
    assert (result.input, result.output) == (8701, 40)


def test_input_settles_on_the_engine_figure() -> None:
    """Chat template framing differs from the OpenAI formula: 21 reported for 25 counted is
    what is billed."""
    s = admitted_session(input_tokens=25)
    s.respond(Responding(200, Metering("stream")))
    s.report(Reported(21, 40))
    result = s.settlement(0, stream=StreamEnd(counted=41, delivered=41, complete=True, cut=False))
    assert (result.input, result.output, result.total) == (21, 40, 61)


def test_an_estimated_count_stands_against_the_engine() -> None:
    """A model counted by the estimator keeps its deliberate over-count."""
    s = admitted_session(model="est", input_tokens=90)
    s.respond(Responding(200, Metering("stream")))
    s.report(Reported(30, 10))
    result = s.settlement(0, stream=StreamEnd(counted=10, delivered=10, complete=True, cut=False))
    assert result.input == 90


def test_stream_output_is_decided_once() -> None:
    """The figure on the last response is the one settlement charges, even if asked again."""
    s = admitted_session()
    s.report(Reported(20, 5))  # far below the recount: a disagreement
    first = s.stream_output(StreamEnd(counted=100, delivered=100, complete=True, cut=False))
    again = s.stream_output(StreamEnd(counted=200, delivered=200, complete=True, cut=False))
    assert first is again
    assert isinstance(first, Figure) and first.disagreement == "low"


def test_a_cut_stream_is_billed_what_was_delivered() -> None:
    """A cut stream is billed the tokens delivered, whatever the upstream says."""
    s = admitted_session()
    s.respond(Responding(200, Metering("stream")))
    s.report(Reported(20, 999))
    result = s.settlement(0, stream=StreamEnd(counted=80, delivered=70, complete=False, cut=True))
    assert result.output == 70


def test_non_2xx_settles_to_nothing() -> None:
    """An upstream error is not charged, input included."""
    s = admitted_session()
    s.respond(Responding(503, Metering("upstream_error")))
    result = s.settlement(0)
    assert result.total == 0 and result.usage == Usage()


@given(ms=st.integers(0, 60_000))
def test_abandoned_request_pays_what_could_have_been_made(ms: int) -> None:
    """A request abandoned before its response pays input plus what the upstream could have
    generated while it ran, never more than the reservation."""
    s = admitted_session(stream=False)
    s.stream_closed(Closed.CANCELLED)
    result = s.settlement(ms)
    cost = s.cost
    assert cost is not None
    expected = min(cost.reserved_output, -(-ms * ABANDONED_TOKENS_PER_SECOND // 1000))
    assert result.ending is Ending.CLIENT_DISCONNECTED
    assert result.output is not None and abs(result.output - expected) <= 1


@pytest.mark.parametrize(("model", "rate"), [("m", 200), ("fast", 1500), ("idle", 0)])
@given(ms=st.integers(0, 10_000))
def test_the_abandon_rate_is_the_models(model: str, rate: int, ms: int) -> None:
    """The abandon rule bills the model's own decode speed (``abandoned_tokens_per_second``,
    200 by default) for the time the request ran, never more than was reserved: an engine
    generates until Envoy's reset aborts it (docs/engine-tests.md)."""
    s = admitted_session(model=model, stream=False)
    assert s.model is not None and s.model.abandoned_tokens_per_second == rate
    s.stream_closed(Closed.CANCELLED)
    result = s.settlement(ms)
    assert result.output == min(500, -(-ms * rate // 1000))
    assert result.total == 20 + result.output


@pytest.mark.parametrize("how", [Closed.EOF, Closed.CANCELLED])
def test_terminal_event_seen_means_completed_whoever_closes(how: Closed) -> None:
    """A client that closes right after [DONE] completed its request."""
    s = admitted_session()
    s.life.advance(Input.RESPONSE_HEADERS)
    s.life.advance(Input.STREAM_START)
    assert s.stream_closed(how, stream_complete=True) is Ending.COMPLETED


@pytest.mark.parametrize("how", [Closed.EOF, Closed.CANCELLED])
def test_a_stream_closed_mid_way_is_a_client_disconnect(how: Closed) -> None:
    """Envoy closes the processor's stream either way when the client leaves: the ending says
    the client left, not that the upstream reset."""
    s = admitted_session()
    s.life.advance(Input.RESPONSE_HEADERS)
    s.life.advance(Input.STREAM_START)
    assert s.stream_closed(how) is Ending.CLIENT_DISCONNECTED


@given(delivered=st.integers(0, 2_000), charged=st.integers(0, 2_000))
def test_pending_units_are_what_settlement_adds(delivered: int, charged: int) -> None:
    """The cut message adds to a counter exactly what settlement will add to it."""
    s = admitted_session()
    tpm = [b for b in s.buckets if b.kind == "tpm"]
    s.account.record_output(tpm, charged)
    s.respond(Responding(200, Metering("stream")))
    result = s.settlement(
        0, stream=StreamEnd(counted=delivered, delivered=delivered, complete=False, cut=True)
    )
    adjustments = {a.key: a.amount for a in s.adjustments(result, list(s.buckets))}
    for b in tpm:
        assert s.pending_units(b, delivered) == adjustments.get(b.key, 0)


def test_cost_is_frozen() -> None:
    """Phase records are immutable."""
    s = admitted_session()
    cost = s.cost
    assert isinstance(cost, Cost)
    with pytest.raises(AttributeError):
        cost.input_tokens = 0  # type: ignore[misc]


def _responding_session(*, stream: bool = True) -> Session:
    """An admitted chat session whose API is known (so its response is metered)."""
    return admitted_session(stream=stream, api=CHAT)


@pytest.mark.parametrize(
    ("headers", "stream", "fail_open", "kind", "state", "ending", "status"),
    [
        (
            {":status": "200", "content-type": "text/event-stream"},
            True,
            False,
            "stream",
            State.STREAMING,
            None,
            200,
        ),
        (
            {":status": "200", "content-type": "application/json"},
            False,
            False,
            "read_json",
            State.READING,
            None,
            200,
        ),
        (
            {":status": "429", "content-type": "application/json"},
            False,
            False,
            "upstream_error",
            State.DONE,
            Ending.UPSTREAM_ERROR,
            429,
        ),
        (
            {":status": "200", "content-type": "application/x-ndjson"},
            True,
            False,
            "unmeterable",
            State.RESPONDING,
            None,
            502,
        ),
        (
            {":status": "200", "content-type": "application/x-ndjson"},
            True,
            True,
            "unmeterable",
            State.DONE,
            Ending.COMPLETED,
            200,
        ),
    ],
)
def test_response_headers_move_the_lifecycle_by_how_the_body_is_metered(
    headers: dict[str, str],
    stream: bool,
    fail_open: bool,
    kind: str,
    state: State,
    ending: Ending | None,
    status: int,
) -> None:
    """The session classifies the response, records it once, and moves its own lifecycle: a
    stream starts, a JSON body is read, an upstream error ends the request by its name, and a
    body the meter cannot read is answered with a 502 (fail-closed) or passes and ends
    (fail-open)."""
    s = _responding_session(stream=stream)
    how = s.response_headers(headers, end_of_stream=False, fail_open=fail_open)
    assert how.kind == kind
    assert s.life.state is state
    assert s.ending is ending
    assert s.status == status
    assert s.streaming is (state is State.STREAMING)
    assert s.reading is (state is State.READING)


def test_a_local_reply_before_the_body_is_named_and_settles_once() -> None:
    """Envoy's own reply before the body reached the gateway is named a local reply; the
    settlement begins once, and its ending is the one named first."""
    s = Session()
    s.request_headers()
    s.request(Requested("r1", "/v1/chat/completions", CHAT))
    how = s.response_headers({":status": "413"}, end_of_stream=True, fail_open=False)
    assert how.kind == "local_reply"
    assert s.ending is Ending.LOCAL_REPLY
    assert s.begin_settlement() and not s.begin_settlement()
    assert s.settle_ending() is Ending.LOCAL_REPLY


_RESPONSES = {
    "sse": {":status": "200", "content-type": "text/event-stream"},
    "json": {":status": "200", "content-type": "application/json"},
    "error": {":status": "503", "content-type": "application/json"},
    "ndjson": {":status": "200", "content-type": "application/x-ndjson"},
}
_EVENTS = st.sampled_from(
    [
        "request_headers",
        "request_body",
        "admission_done",
        "pass_through",
        "refused",
        "rejected",
        *(f"response_headers:{k}" for k in _RESPONSES),
        "response_body",
        "response_trailers",
        "response_read",
        "begin_settlement",
    ]
)


def _feed(s: Session, ev: str, *, fail_open: bool) -> bool | None:
    """Apply one named event to the session (what the server reports)."""
    if ev.startswith("response_headers:"):
        s.response_headers(_RESPONSES[ev.split(":")[1]], end_of_stream=False, fail_open=fail_open)
        return None
    if ev in ("refused", "rejected"):
        s.answered(refused=ev == "refused")
        return None
    if ev == "begin_settlement":
        return s.begin_settlement()
    getattr(s, ev)()
    return None


@settings(deadline=None)  # the first example compiles the rules
@given(
    events=st.lists(_EVENTS, max_size=12),
    admitted=st.booleans(),
    fail_open=st.booleans(),
    how=st.sampled_from(list(Closed)),
)
def test_any_order_of_events_moves_the_session_by_its_table_only(
    events: list[str], admitted: bool, fail_open: bool, how: Closed
) -> None:
    """Whatever the server reports, in whatever order: an event the phase does not allow is a
    LifecycleError and changes nothing; the first ending named stays; settlement begins once;
    an ended response stays ended; and the close always names an ending."""
    s = admitted_session(api=CHAT) if admitted else Session()
    if not admitted:
        s.request(Requested("r1", "/v1/chat/completions", CHAT))
    began = 0
    for ev in events:
        before = (s.life.state, s.ending, s.status)
        was_ended = s.ended
        try:
            got = _feed(s, ev, fail_open=fail_open)
        except LifecycleError:
            assert (s.life.state, s.ending) == before[:2], "a refused event changed the session"
            continue
        if got:
            began += 1
        if before[1] is not None:
            assert s.ending is before[1], "the first ending named stays"
        if was_ended:
            assert s.ended, "an ended response stays ended"
    assert began <= 1
    assert s.stream_closed(how) is not None
    assert s.ending is not None


def test_the_request_and_its_caller_are_each_recorded_once() -> None:
    """The request's own facts (read before the caller is known) and the caller are two
    records, each set once; the API errors speak is the path's, then the routed one."""
    s = Session()
    s.request(Requested("r1", "/v1/chat/completions", CHAT))
    assert s.request_id == "r1" and s.api is CHAT and s.tenant is None
    with pytest.raises(PhaseError):
        s.request(Requested("r2"))
    cfg = config()
    tenant = cfg.tenants["t"]
    key = next(iter(cfg.keys_by_digest.values()))
    s.identify(Identified("r1", "/v1/chat/completions", CHAT, key, tenant, "ledger-1"))
    assert s.tenant is tenant and s.ledger == "ledger-1"
    with pytest.raises(PhaseError):
        s.identify(Identified("r1", "/v1/chat/completions", CHAT, key, tenant, "ledger-2"))
