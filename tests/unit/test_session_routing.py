"""Session.handle as the one door of a request: each event reaches the machine whose vocabulary
it belongs to (the envelope, admission, the metered stream), over any order of events.  The
sub-machines here are recorders (the routing is pure logic; the machines have their own
tests): a sub-machine's event before it started is a PhaseError that starts nothing and
reaches nobody; the body (or an rpm_only path) starts admission once, moving the lifecycle for
the body; the stream starts with the response headers that say it is one, once."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core import admission_vocabulary as av
from extproc.core import envelope as ev
from extproc.core import stream_vocabulary as sv
from extproc.core.apis.openai import CHAT
from extproc.core.lifecycle import LifecycleError
from extproc.core.phase_records import PhaseError, Requested
from extproc.core.session import Session

pytestmark = pytest.mark.unit


class Recorder:
    """A sub-machine that keeps what it is fed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fed: list[Any] = []

    def handle(self, event: Any) -> list[Any]:
        self.fed.append(event)
        return []


class Builders:
    """Builds recorders, and keeps each one built."""

    def __init__(self) -> None:
        self.built: list[Recorder] = []

    def admission(self, s: Any) -> Recorder:
        self.built.append(Recorder("admission"))
        return self.built[-1]

    def stream(self, s: Any, decoder: Any) -> Recorder:
        self.built.append(Recorder("stream"))
        return self.built[-1]


EVENTS: dict[str, Any] = {
    "body": av.BodyArrived(b"{}"),
    "rpm_only": av.RpmOnlyArrived(),
    "counted": av.InputCounted(3),
    "answered": av.AdmitAnswered(True, False, ()),
    "cancelled": av.AdmitCancelled(),
    "chunk": sv.BodyChunk(b"data: x\n\n", False),
    "trailers": sv.Trailers(),
    "count_done": sv.CountDone(),
    "stream_starts": "stream_starts",  # the response's headers classify it as a stream
}


@given(names=st.lists(st.sampled_from(sorted(EVENTS)), max_size=12))
def test_each_event_reaches_its_own_machine_once_started(names: list[str]) -> None:
    """Any order of admission's, the stream's and the stream's start: each machine is built
    once and gets exactly its own events, in order; a refused event moves nothing."""
    builders = Builders()
    s = Session(builders)
    s.handle(ev.RequestHeaders(Requested("r1", "/v1/chat/completions", CHAT)))
    fed: dict[str, list[Any]] = {"admission": [], "stream": []}
    for name in names:
        event = EVENTS[name]
        if event == "stream_starts":
            try:
                s.start_stream(None)
            except PhaseError:
                assert s.stream is not None  # only a second start is refused
            continue
        kind = "admission" if type(event) in av.ADMISSION_EVENTS else "stream"
        machine = [b for b in builders.built if b.name == kind]
        before = (s.life.state, len(builders.built))
        starts = isinstance(event, av.BodyArrived | av.RpmOnlyArrived)
        try:
            assert s.handle(event) == []
        except PhaseError:
            assert (s.life.state, len(builders.built)) == before  # refused: nothing moved
            assert not machine and not starts  # only a machine not started refuses
            continue
        fed[kind].append(event)
        if not machine:
            assert kind == "admission" and starts  # only a start builds admission
    for kind, events in fed.items():
        built = [b for b in builders.built if b.name == kind]
        assert len(built) <= 1, f"{kind} built twice"
        assert (built[0].fed if built else []) == events


def test_the_body_moves_the_lifecycle_before_admission_starts() -> None:
    """A body out of order (before the request's headers) is the lifecycle's error: no
    admission is built, nothing is fed."""
    builders = Builders()
    s = Session(builders)
    with pytest.raises(LifecycleError):
        s.handle(av.BodyArrived(b"{}"))
    assert not builders.built


def test_a_session_without_builders_has_no_sub_machines() -> None:
    """Without builders (a session driven by its envelope alone) admission cannot start, and
    a stream's headers start nothing: its events are refused."""
    s = Session()
    s.handle(ev.RequestHeaders(Requested("r1", "/v1/chat/completions", CHAT)))
    with pytest.raises(PhaseError):
        s.handle(av.BodyArrived(b"{}"))
    s.start_stream(None)
    assert s.stream is None
    with pytest.raises(PhaseError):
        s.handle(sv.Trailers())
