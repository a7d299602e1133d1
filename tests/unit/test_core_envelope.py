"""Unit tests for the request's envelope (extproc.core.envelope): each response kind asks the
server for the actions it must execute, in order; settlement is asked for once whatever the
order of events; an event the lifecycle does not allow changes nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import envelope as ev
from extproc.core.apis.openai import CHAT
from extproc.core.lifecycle import Closed, CutReason, Ending, LifecycleError
from extproc.core.phase_records import PhaseError, Reported, Requested
from extproc.core.session import Session
from extproc.errors import UnmeterableResponse
from tests.unit.test_core_session import admitted_session

pytestmark = pytest.mark.unit

SSE = {":status": "200", "content-type": "text/event-stream"}
JSON = {":status": "200", "content-type": "application/json"}
ERROR = {":status": "503", "content-type": "application/json"}
NDJSON = {":status": "200", "content-type": "application/x-ndjson"}
FULL_DUPLEX = ev.BodyMode.FULL_DUPLEX


def _headers(s: Session, headers: dict[str, str], *, fail_open: bool = False) -> ev.Actions:
    return s.handle(ev.ResponseHeaders(headers, end_of_stream=False, fail_open=fail_open))


def _kinds(actions: ev.Actions) -> list[type]:
    return [type(a) for a in actions]


def test_a_stream_is_counted_metered_and_forwarded_full_duplex() -> None:
    """SSE: the input count starts, the meter takes the body, and the headers go back with the
    rate limits, without a length or encoding, in full duplex, with the figures so far."""
    s = admitted_session(api=CHAT)
    actions = _headers(s, SSE)
    assert _kinds(actions) == [ev.CountInput, ev.MeterStream, ev.ForwardHeaders]
    fwd = actions[-1]
    assert isinstance(fwd, ev.ForwardHeaders)
    assert fwd.headers == tuple(s.headers_out)
    assert fwd.remove == ("content-length", "content-encoding")
    assert fwd.mode is FULL_DUPLEX and fwd.figures is ev.Figures.SO_FAR
    assert s.streaming


def test_a_non_stream_sent_as_a_stream_is_rebuilt_as_json() -> None:
    """The exact path: the kept stream is rebuilt, its answer is JSON."""
    s = admitted_session(api=CHAT, stream=False)
    adm = s.admitted
    assert adm is not None and adm.cost is not None
    # admitted as the exact path admits a non-stream (sent upstream as a stream)
    s._admitted = replace(adm, cost=replace(adm.cost, upstream_stream=True))
    actions = _headers(s, SSE)
    assert _kinds(actions) == [ev.CountInput, ev.RebuildJson, ev.ForwardHeaders]
    fwd = actions[-1]
    assert isinstance(fwd, ev.ForwardHeaders)
    assert fwd.headers[-1] == ("content-type", "application/json")
    assert fwd.mode is FULL_DUPLEX and s.reading


def test_a_json_body_is_read_then_settled_once_with_its_output() -> None:
    """A JSON body is read as Envoy streams it; at its end the usage decides the output, the
    figures are made ready, then the response is over and settlement is asked for once."""
    s = admitted_session(api=CHAT, stream=False)
    actions = _headers(s, JSON)
    assert _kinds(actions) == [ev.CountInput, ev.ReadJson, ev.ForwardHeaders]
    assert actions[-1] == ev.ForwardHeaders(
        tuple(s.headers_out), (), ev.BodyMode.STREAMED, ev.Figures.SO_FAR
    )
    assert s.handle(ev.ResponseChunk()) == ()
    assert s.handle(ev.BodyRead(Reported(20, 7))) == (ev.FiguresReady(),)
    assert s.output_decided == 7
    assert s.handle(ev.ResponseDone()) == (ev.Settle(),)
    assert s.ended
    assert s.handle(ev.ResponseOver()) == (ev.StartSettlement(),)
    assert s.handle(ev.ResponseOver()) == ()  # once
    s.handle(ev.SettlementStarts())
    assert s.ending is Ending.COMPLETED


def test_an_upstream_error_readies_its_figures_and_settles_without_output() -> None:
    s = admitted_session(api=CHAT, stream=False)
    actions = _headers(s, ERROR)
    assert actions == (
        ev.FiguresReady(),
        ev.Settle(),
        ev.ForwardHeaders(tuple(s.headers_out), figures=ev.Figures.NO_OUTPUT),
    )
    assert s.ending is Ending.UPSTREAM_ERROR


def test_an_unmeterable_body_is_refused_or_passed_by_the_failure_mode() -> None:
    """Fail-closed: a 502 counted as an unmeterable cut; fail-open: logged, passed, settled."""
    closed = _headers(admitted_session(api=CHAT), NDJSON)
    assert len(closed) == 1
    reject = closed[0]
    assert isinstance(reject, ev.Reject) and reject.cut is CutReason.UNMETERABLE
    assert isinstance(reject.error, UnmeterableResponse) and reject.error.status == 502
    assert "application/x-ndjson" in reject.error.message
    s = admitted_session(api=CHAT)
    opened = _headers(s, NDJSON, fail_open=True)
    assert _kinds(opened) == [ev.Unmetered, ev.Settle, ev.ForwardHeaders]
    assert opened[-1] == ev.ForwardHeaders(tuple(s.headers_out))
    assert s.ended


def test_a_local_reply_forwards_nothing_of_ours() -> None:
    """Envoy's own reply (before the body reached the gateway) gets no headers and no figures."""
    s = Session()
    s.handle(ev.RequestHeaders(Requested("r1", "/v1/chat/completions", CHAT)))
    got = s.handle(ev.ResponseHeaders({":status": "413"}, end_of_stream=True, fail_open=False))
    assert got == (ev.ForwardHeaders(),)
    assert s.ending is Ending.LOCAL_REPLY


def test_the_request_is_named_once() -> None:
    """Request headers twice: the lifecycle refuses the second."""
    s = Session()
    s.handle(ev.RequestHeaders(Requested("r1", "/v1/chat/completions", CHAT)))
    with pytest.raises((LifecycleError, PhaseError)):
        s.handle(ev.RequestHeaders(Requested("r2", "/v1/chat/completions", CHAT)))
    assert s.request_id == "r1"


_RESPONSES = {"sse": SSE, "json": JSON, "error": ERROR, "ndjson": NDJSON}
_EVENT_NAMES = [
    "request_body",
    "admission_done",
    "pass_through",
    "refused",
    "rejected",
    *(f"headers:{k}" for k in _RESPONSES),
    "chunk",
    "body_read",
    "response_done",
    "trailers",
    "over",
]


def _event(name: str, fail_open: bool) -> ev.EnvelopeEvent:
    simple: dict[str, ev.EnvelopeEvent] = {
        "request_body": ev.RequestBody(),
        "admission_done": ev.AdmissionDone(),
        "pass_through": ev.PassThrough(),
        "refused": ev.Answered(refused=True),
        "rejected": ev.Answered(refused=False),
        "chunk": ev.ResponseChunk(),
        "body_read": ev.BodyRead(Reported(20, 5)),
        "response_done": ev.ResponseDone(),
        "trailers": ev.ResponseTrailers(),
        "over": ev.ResponseOver(),
    }
    if name.startswith("headers:"):
        return ev.ResponseHeaders(_RESPONSES[name.split(":")[1]], False, fail_open)
    return simple[name]


@settings(deadline=None)  # the first example compiles the rules
@given(
    names=st.lists(st.sampled_from(_EVENT_NAMES), max_size=14),
    admitted=st.booleans(),
    fail_open=st.booleans(),
    how=st.sampled_from(list(Closed)),
)
def test_any_order_of_events_asks_for_settlement_once(
    names: list[str], admitted: bool, fail_open: bool, how: Closed
) -> None:
    """Whatever the server reports, in whatever order (duplicates, late events): an event the
    lifecycle refuses changes nothing; settlement is asked for once across the response's end
    and the stream's close; a response's headers are answered with exactly one Envoy response
    (forwarded or rejected); the close always names an ending."""
    s = admitted_session(api=CHAT) if admitted else Session()
    if not admitted:
        s.handle(ev.RequestHeaders(Requested("r1", "/v1/chat/completions", CHAT)))
    settles = 0
    for name in names:
        before = (s.life.state, s.ending)
        try:
            actions = s.handle(_event(name, fail_open))
        except LifecycleError:
            assert (s.life.state, s.ending) == before, "a refused event changed the session"
            continue
        except PhaseError:
            continue  # a record set twice (a second response's headers): refused, as before
        if name.startswith("headers:"):
            answers = [a for a in actions if isinstance(a, ev.ForwardHeaders | ev.Reject)]
            assert len(answers) == 1
        if name == "over":
            assert all(a == ev.StartSettlement() for a in actions)
            settles += len(actions)
    for action in s.handle(ev.StreamClosed(how)):
        assert action == ev.Settle()
    settles += len(s.handle(ev.ResponseOver()))
    assert settles <= 1
    assert s.ending is not None
