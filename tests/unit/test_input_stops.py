"""An upstream that under-reports the prompt (issue 33): the input shortcut (billing a request
admitted on a bound at the upstream's own input figure, without a count) is earned per model
after each start and config change, never runs more than ``input_audit_every - 1`` requests of
a model between two counts in one process, and a disagreement found by one replica stops it on
every replica and across restarts (through the limiter, here the in-memory one shared by
several gateways as Redis is by several processes)."""

from __future__ import annotations

import asyncio

import pytest

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.core.audits import InputAudits, Suspects
from extproc.core.keys import input_stops_key
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from tests.limiters import RecordingLimiter
from tests.unit.test_input_bound import complete_json, request, settled, tokenizer_runs, tpm_value

pytestmark = pytest.mark.unit

RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 50}
charging: {charge_every_tokens: 4, streaming: lazy}
requests: {admit_on_bound: true, count_refused_requests: true, input_audit_every: %d}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 1000, tpm: 10000000}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""


def gateway(
    lim: RecordingLimiter, *, every: int = 16, version: str = "v1", prefix: str = "aiq"
) -> Gateway:
    """A gateway (a replica) on ``lim`` under config version ``version``."""
    cfg = load_config_text(RULES % every)
    gw = Gateway(
        config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics(), key_prefix=prefix
    )
    gw.install(cfg, version)
    return gw


def shared() -> RecordingLimiter:
    return RecordingLimiter(MemoryLimiter(FakeClock()))


def metric(gw: Gateway, name: str, model: str = "m") -> float:
    return float(getattr(gw.metrics, name).labels(model)._value.get())


async def verified(gw: Gateway, lim: RecordingLimiter) -> int:
    """A first request, counted (no hint yet), whose upstream figure agrees: the shortcut is
    earned.  Its exact input."""
    first, _ = await request(gw, 0)
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact)
    return exact


async def open_requests(gw: Gateway, n: int, start: int) -> list[RequestProcessor]:
    """``n`` requests admitted (on the bound), none answered yet."""
    return [(await request(gw, start + i))[0] for i in range(n)]


def test_the_shortcut_is_earned_kept_under_audit_and_lost() -> None:
    """The table alone: probation until a count agrees; per model one admission in ``every``
    counted; at most ``every - 1`` uncounted bills (reserved or billed) since the latest
    agreeing figure; a disagreement stops it and hands back the suspects; a config change
    starts over."""
    a = InputAudits()
    assert a.count_now("m", 4) and not a.take_uncounted("m", 4)  # probation: counted
    a.agreed("m", 1)
    # per model: another model's traffic cannot push this one's audits away
    assert [a.count_now("m", 4) for _ in range(8)] == [False, False, False, True] * 2
    assert [a.count_now("other", 4) for _ in range(3)] == [True] * 3  # other: in probation
    assert [a.take_uncounted("m", 4) for _ in range(5)] == [True, True, True, False, False]
    for seq in (2, 3, 4):  # the three settle at the upstream's figure
        a.billed_uncounted("m", 40, seq, 2000)
        a.release("m")
    assert not a.take_uncounted("m", 4)  # the bills hold the room, not the reservations
    a.agreed("m", 3)  # a count of a figure read between them vouches for the two before it
    assert a.take_uncounted("m", 4) and a.take_uncounted("m", 4)
    assert not a.take_uncounted("m", 4)
    a.release("m")
    a.release("m")
    assert a.disagreed("m") == Suspects(1, 40, ((40, 2000),)) and a.stopped("m")
    # 40 reported for 1000 counted: each bill 960 short, an honest one capped by its bound
    assert Suspects(2, 540, ((40, 2000), (500, 600))).unbilled_estimate(40, 1000) == 960 + 100
    assert a.disagreed("m") is None and a.count_now("m", 4) and not a.take_uncounted("m", 4)
    a.agreed("m", 9)  # a later agreeing count does not bring a stopped shortcut back
    assert a.stopped("m")
    assert a.stopped_elsewhere(["m", "n"]) == ["n"]
    a.reset()  # a new config version
    assert not a.stopped("m") and not a.stopped("n") and a.count_now("m", 4)


def test_a_stale_agreement_does_not_clear_bills_read_after_it() -> None:
    """An audit whose figure was read before the upstream began to under-report, settling
    after requests billed at the new figures (its count took longer): it vouches for nothing
    read after it, so those bills keep holding the room."""
    a = InputAudits()
    a.agreed("m", 1)
    assert a.take_uncounted("m", 4) and a.take_uncounted("m", 4)
    a.billed_uncounted("m", 10, 5, 900)
    a.billed_uncounted("m", 10, 6, 900)
    a.release("m")
    a.release("m")
    a.agreed("m", 4)  # read before both bills
    assert a.take_uncounted("m", 4) and not a.take_uncounted("m", 4)


async def test_an_upstream_lying_from_the_start_never_bills_a_request_uncounted() -> None:
    """Reporting 4 % of the prompt from the first request: that request is counted (nothing
    earned yet), disagrees and stops the shortcut; every later one is counted and billed its
    count, none at the upstream's figure (K = 0 for such an upstream)."""
    lim = shared()
    gw = gateway(lim)
    first, _ = await request(gw, 0)
    exact = first.s.cost.input_tokens if first.s.cost else 0
    lie = exact * 4 // 100
    fair = exact  # a figure below the counted path's bounds is not believed: the count
    await complete_json(first, lie)
    assert gw.input_audits.stopped("m") and metric(gw, "input_shortcut_stops") == 1
    runs = tokenizer_runs(gw)
    for n in range(1, 21):
        proc, _ = await request(gw, n)
        await complete_json(proc, lie)
        assert proc.s.input_tokens() == fair and not proc.s.input_uncounted
    assert tokenizer_runs(gw) == runs + 20


async def test_one_replica_bills_at_most_every_minus_one_uncounted_between_counts() -> None:
    """An upstream that starts under-reporting once the shortcut is earned, with ten requests
    open at once (the admission sampler counts the 4th and 8th): the first three answered are
    billed at its figure, the next is counted at settlement whatever the sampler did, disagrees
    and stops the shortcut, and the rest are counted; the stop reports the three suspects."""
    lim = shared()
    gw = gateway(lim, every=4)
    exact = await verified(gw, lim)
    lie = exact * 4 // 100 + 1
    procs = await open_requests(gw, 10, 1)
    await asyncio.sleep(0)  # the audits' counts start
    unaudited = [p for i, p in enumerate(procs, 1) if i % 4]
    for p in unaudited:
        await complete_json(p, lie)
    uncounted = [p for p in unaudited if p.s.input_uncounted]
    assert len(uncounted) == 3 and uncounted == unaudited[:3]
    assert gw.input_audits.stopped("m")
    for p in procs:
        if p not in unaudited:
            await complete_json(p, lie)
    assert [p.s.input_uncounted for p in procs].count(True) == 3
    assert metric(gw, "input_shortcut_stops") == 1
    assert metric(gw, "input_unbilled_estimate") == 3 * (lie * (exact - lie) // lie)


async def test_a_stop_found_by_one_replica_holds_on_every_replica_and_after_a_restart() -> None:
    """Replica A finds the disagreement and writes it; replica B, which had earned the
    shortcut, reads it at its next refresh and counts every request from then on; a replica
    started afterwards (a restart) reads it before its first request; a config change (a new
    version) starts over on the replica that installed it."""
    lim = shared()
    a, b = gateway(lim), gateway(lim)
    exact = await verified(a, lim)
    await verified(b, lim)
    assert not b.input_audits.stopped("m")
    lie = exact * 4 // 100 + 1
    probe, _ = await request(a, 1)
    await asyncio.sleep(0)
    proc = probe
    n = 2
    while not a.input_audits.stopped("m"):  # until A's count disagrees
        await complete_json(proc, lie)
        proc, _ = await request(a, n)
        n += 1
    await complete_json(proc, lie)
    await settled(a)
    assert await lim.inner.input_stops(input_stops_key("aiq", "v1")) == ["m"]
    assert await b.background.stops.refresh() == ["m"]
    assert b.input_audits.stopped("m") and metric(b, "input_stops_adopted") == 1
    before = await tpm_value(lim, proc)
    for i in range(5):
        p, _ = await request(b, 100 + i)
        await complete_json(p, lie)
        assert not p.s.input_uncounted and p.s.input_tokens() == exact  # the count
    assert await tpm_value(lim, p) > before
    restarted = gateway(lim)  # a new process: nothing in memory
    assert not restarted.input_audits.stopped("m")
    assert await restarted.background.stops.refresh() == ["m"]
    assert restarted.input_audits.stopped("m")
    b.install(b.config, "v2")  # the rules changed: the stops of v1 no longer hold here
    assert not b.input_audits.stopped("m") and await b.background.stops.refresh() == []
    assert b.input_audits.count_now("m", 16)  # but the shortcut must be earned again
