"""Admission on an upper bound of the input (issue 17): the UTF-8 bound never under-counts any
API's request, it is used only where the counters have ample room, the exact count replaces it
before any figure is decided, and a bound the limiter refuses is counted and asked again, so
the bound never changes an admission's answer nor what a request is billed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import orjson
import pytest
import structlog.testing
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.clock import FakeClock
from extproc.config import load_config_text
from extproc.config.runtime import Model
from extproc.core.admission_rules import bound_input
from extproc.core.apis.base import RequestLimits
from extproc.core.apis.registry import api_for_path
from extproc.core.audits import InputAudits
from extproc.core.counters import (
    EstimateCounter,
    TiktokenCounter,
    UTF8BoundCounter,
    upper_bound_counter,
)
from extproc.core.lifecycle import Closed
from extproc.core.room_hints import MAX_ROOM_HINTS, RoomHints
from extproc.core.rules import BucketCharge
from extproc.core.tokens import TokenizerSpec
from extproc.errors import GatewayError
from extproc.gateway import Gateway
from extproc.limiter.memory import MemoryLimiter
from extproc.metrics import Metrics
from extproc.server.processor import RequestProcessor
from extproc.tokenizers import bundled_encoding
from tests.limiters import RecordingLimiter
from tests.unit.test_processor_flow import event, feed, headers

pytestmark = pytest.mark.unit

EXACT = TiktokenCounter(bundled_encoding())
# small pieces: long texts are cut, so the forced-cut slack is exercised too
CUT = TiktokenCounter(bundled_encoding(), max_piece_chars=64)
SPEC = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")

texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=400) | st.builds(
    lambda c, n: c * n,
    st.sampled_from(["a", " ", "=", "日", "🙂", "\n", "ab"]),
    st.integers(0, 3000),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts)
def test_utf8_bound_is_never_below_the_tiktoken_count(text: str) -> None:
    """Every text: the bound is at least tiktoken's count, with and without forced cuts."""
    for counter in (EXACT, CUT):
        bound = UTF8BoundCounter(counter)
        assert bound.count(text) >= counter.count(text)


def test_only_tiktoken_has_a_proven_bound() -> None:
    """An estimate (already cheap) and anything but tiktoken itself get no bound."""
    assert isinstance(upper_bound_counter(EXACT), UTF8BoundCounter)
    assert upper_bound_counter(EstimateCounter()) is None

    class Derived(TiktokenCounter):
        pass

    assert upper_bound_counter(Derived(bundled_encoding())) is None


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "text":
        return {"type": "text", "text": text}
    return {"type": "image_url", "image_url": {"url": "https://x.test/i.png"}}


def _bodies(text: str, more: list[str], parts: list[str]) -> dict[str, dict[str, Any]]:
    content: Any = [_part(k, t) for k, t in zip(parts, [text, *more], strict=False)] or text
    msgs = [{"role": "system", "content": text}, {"role": "user", "content": content}]
    msgs += [{"role": "assistant", "content": m, "name": "bob"} for m in more]
    tools = [{"type": "function", "function": {"name": "f", "description": text, "parameters": {}}}]
    return {
        "/v1/chat/completions": {"model": "m", "messages": msgs, "tools": tools},
        "/v1/completions": {"model": "m", "prompt": [text, *more]},
        "/v1/responses": {"model": "m", "instructions": text, "input": [*more, text]},
        "/v1/messages": {
            "model": "m",
            "max_tokens": 5,
            "system": text,
            "messages": [{"role": "user", "content": c} for c in [text, *more]],
        },
        "/v1/embeddings": {"model": "m", "input": [text, *more]},
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.lists(texts, max_size=3), st.lists(st.sampled_from(["text", "image"]), max_size=3))
def test_the_bound_walk_covers_every_api(text: str, more: list[str], parts: list[str]) -> None:
    """For every API's request shapes (system prompts, parts, images, names, tools), walking
    the body with the bound counter gives at least the exact count."""
    limits = RequestLimits(max_tokens_ceiling=1_000_000, max_n=16)
    bound = UTF8BoundCounter(EXACT)
    for path, body in _bodies(text, more, parts).items():
        api = api_for_path(path)
        assert api is not None
        try:
            req = api.parse(orjson.dumps(body), limits)
        except GatewayError:
            continue  # refused before counting, bound or not
        assert api.count_input(req, bound, SPEC) >= api.count_input(req, EXACT, SPEC), path


def _charge(key: str, amount: int, limit: int, *, shadow: bool = False) -> BucketCharge:
    return BucketCharge(key, "tpm", amount, limit, 0, shadow=shadow)


def test_room_hints_allow_a_bound_only_with_ample_room() -> None:
    """Unseen counters, room below headroom x the charge, or a counter that would pass its
    share of the limit mean count first; RPM and shadow counters do not matter; the table is
    bounded."""
    hints = RoomHints()
    a, b = _charge("a", 100, 1000), _charge("b", 100, 1000)
    assert not hints.ample([a], 4.0)
    hints.note([a, BucketCharge("r", "rpm", 1, 5, 0)], (500, 5))
    assert hints.ample([a], 4.0) and not hints.ample([a], 6.0)
    assert hints.ample([a], 4.0, share=0.9) and not hints.ample([a], 4.0, share=0.85)
    assert hints.ample([a], 4.0, {"a": 100}) and not hints.ample([a], 4.0, {"a": 101})
    assert not hints.ample([a, b], 4.0)  # b never seen
    assert hints.ample([a, _charge("b", 100, 1000, shadow=True)], 4.0)
    for i in range(MAX_ROOM_HINTS + 1):
        hints.note([_charge(f"k{i}", 1, 10)], (0,))
    assert len(hints) <= MAX_ROOM_HINTS


RULES = """
models:
  m: {tokenizer: {kind: tiktoken, encoding: cl100k_base}, max_output_tokens: 50}
charging: {charge_every_tokens: 4, streaming: %s}
requests: {count_refused_requests: true, admit_on_bound: true, input_audit_every: %d, bound_below: %s}
plans:
  p: {limits: [{model: "*", per: hour, rpm: 100, tpm: %d}]}
tenants:
  t: {plan: p, keys: [{name: k, plaintext: sk-t}]}
"""

PROMPT = "the quick brown fox jumps over the lazy dog " * 20


def gateway(
    tpm: int, streaming: str = "lazy", *, audit: int = 1, below: float = 1.0
) -> tuple[Gateway, RecordingLimiter]:
    """A gateway on the in-memory limiter; ``audit``: one bound admission in that many is
    counted exactly at once (1: all of them); ``below``: ``requests.bound_below``."""
    lim = RecordingLimiter(MemoryLimiter(FakeClock()))
    cfg = load_config_text(RULES % (streaming, audit, below, tpm))
    return Gateway(config=cfg, limiter=lim, clock=lim.inner.clock, metrics=Metrics()), lim


async def request(
    gw: Gateway, n: int, *, stream: bool = False, prompt: str = PROMPT
) -> tuple[RequestProcessor, Any]:
    """Request headers and body; the request-body answer."""
    proc = RequestProcessor(gw)
    await proc.handle(
        pb.ProcessingRequest(
            request_headers=headers(
                {
                    ":path": "/v1/chat/completions",
                    ":method": "POST",
                    "authorization": "Bearer sk-t",
                    "x-request-id": f"r{n}",
                }
            )
        )
    )
    body = {"model": "m", "max_tokens": 10, "stream": stream}
    body["messages"] = [{"role": "user", "content": prompt}]
    [resp] = await proc.handle(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True))
    )
    return proc, resp


async def complete_json(
    proc: RequestProcessor, prompt_tokens: int | None, *, usage: bool = True
) -> None:
    """A 200 JSON answer with the engine's usage (without ``prompt_tokens`` when None; none
    at all unless ``usage``), then the stream closes."""
    await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "application/json"})
        )
    )
    figures: dict[str, Any] = {"completion_tokens": 5}
    if prompt_tokens is not None:
        figures["prompt_tokens"] = prompt_tokens
    answer: dict[str, Any] = {"object": "chat.completion", "choices": []}
    if usage:
        answer["usage"] = figures
    body = orjson.dumps(answer)
    await proc.handle(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True))
    )
    proc.close(Closed.EOF)
    await settled(proc.gw)


async def first_request(gw: Gateway, lim: RecordingLimiter) -> tuple[RequestProcessor, int, int]:
    """A first request, counted first (no hint yet) and completed with the engine's figure
    equal to the count: the processor, its exact input and the TPM counter after it."""
    first, _ = await request(gw, 1)
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact)
    return first, exact, await tpm_value(lim, first)


async def settled(gw: Gateway) -> None:
    while gw.background.pending:
        await asyncio.gather(*list(gw.background.pending))
    batcher = gw.background.settle_batcher
    if batcher is not None:
        assert await batcher.wait_idle(5.0)


def admissions(gw: Gateway, how: str) -> float:
    return float(gw.metrics.input_admissions.labels(how)._value.get())


async def tpm_value(lim: RecordingLimiter, proc: RequestProcessor) -> int:
    [tpm] = [b for b in proc.s.buckets if b.kind == "tpm"]
    [value] = await lim.inner.read([tpm.key])
    return value


async def test_a_request_admitted_on_the_bound_is_billed_as_one_counted_first() -> None:
    """The first request (no hint yet) is counted first; the second, with ample room, is
    admitted on the bound, which reserved more, and settles to the same figures."""
    gw, lim = gateway(1_000_000)
    first, _ = await request(gw, 1)
    assert admissions(gw, "exact") == 1 and not first.s.input_pending
    reported = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, reported)
    after_first = await tpm_value(lim, first)

    second, resp = await request(gw, 2)
    assert resp.WhichOneof("response") == "request_body"
    assert admissions(gw, "bound") == 1
    charged = [b.amount for b in lim.admits[-1] if b.kind == "tpm"]
    assert charged[0] > reported + 10  # the bound, well above the count
    await complete_json(second, reported)
    assert second.s.cost is not None and second.s.cost.input_tokens == reported
    assert await tpm_value(lim, second) == 2 * after_first


async def test_near_the_limit_the_prompt_is_counted_first() -> None:
    """Room for the request but not for headroom x its bound: counted first, admitted."""
    gw, lim = gateway(1_000_000)
    first, _ = await request(gw, 1)
    await complete_json(first, first.s.cost.input_tokens if first.s.cost else 0)
    used = await tpm_value(lim, first)
    assert first.s.cost is not None
    bound = next(b.amount for b in lim.admits[0] if b.kind == "tpm")
    # leave room for two exact requests but not for 4 x the bound
    [tpm] = [b for b in first.s.buckets if b.kind == "tpm"]
    lim.inner.seed_counter(tpm.key, tpm.limit.limit - 2 * used)
    gw.room.note(lim.admits[0], (tpm.limit.limit - 2 * used,) * len(lim.admits[0]))
    assert bound * 4 > 2 * used
    _, resp = await request(gw, 2)
    assert resp.WhichOneof("response") == "request_body"
    assert admissions(gw, "exact") == 2 and admissions(gw, "bound") == 0


async def test_a_refused_bound_is_counted_and_asked_again() -> None:
    """Stale hints (another replica used the room): the bound is refused, the exact count is
    admitted, and the RPM counter counts the request once although refusals are counted."""
    gw, lim = gateway(1_000_000)
    first, _ = await request(gw, 1)
    await complete_json(first, first.s.cost.input_tokens if first.s.cost else 0)
    used = await tpm_value(lim, first)
    [tpm] = [b for b in first.s.buckets if b.kind == "tpm"]
    [rpm] = [b for b in first.s.buckets if b.kind == "rpm"]
    exact = first.s.cost.input_tokens if first.s.cost else 0
    start = tpm.limit.limit - (exact + 10)  # room for the input and max_tokens, not the bound
    lim.inner.seed_counter(tpm.key, start)
    proc, resp = await request(gw, 2)
    assert resp.WhichOneof("response") == "request_body"
    assert admissions(gw, "recounted") == 1
    assert [await lim.inner.read([rpm.key])] == [[2]]
    await complete_json(proc, proc.s.cost.input_tokens if proc.s.cost else 0)
    assert await tpm_value(lim, proc) == start + used <= tpm.limit.limit


async def test_a_request_abandoned_before_its_response_settles_on_the_exact_count() -> None:
    """The client leaves right after admission: settlement waits for the exact count and
    keeps only the input and the abandoned output's allowance."""
    gw, lim = gateway(1_000_000)
    _, exact, before = await first_request(gw, lim)
    proc, _ = await request(gw, 2)
    assert admissions(gw, "bound") == 1
    proc.close(Closed.CANCELLED)
    await settled(gw)
    assert proc.s.cost is not None and proc.s.cost.input_tokens == exact
    assert await tpm_value(lim, proc) == before + exact  # no output: it left at once


async def test_strict_streams_admitted_on_the_bound_never_go_over() -> None:
    """Strict streams at the boundary: whatever was reserved on the bound, what is delivered
    plus the exact input never exceeds the limit."""
    gw, lim = gateway(1_000_000, "strict")
    first, _ = await request(gw, 1)
    await complete_json(first, first.s.cost.input_tokens if first.s.cost else 0)
    used = await tpm_value(lim, first)
    [tpm] = [b for b in first.s.buckets if b.kind == "tpm"]
    exact = first.s.cost.input_tokens if first.s.cost else 0
    assert used > 0
    lim.inner.seed_counter(tpm.key, tpm.limit.limit - exact - 6)  # room: the input + 6 tokens
    proc, resp = await request(gw, 2, stream=True)
    assert resp.WhichOneof("response") == "request_body"
    await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "text/event-stream"})
        )
    )
    for i in range(30):
        await feed(proc, event(f" w{i}"))
        if proc.s.life.ended:
            break
    proc.close(Closed.EOF)
    await settled(gw)
    assert proc.driver is not None and proc.driver.meter.delivered <= 6
    assert await tpm_value(lim, proc) <= tpm.limit.limit


def prompt_bound(proc: RequestProcessor) -> int:
    """The upper bound admission would use for the test's prompt."""
    s = proc.s
    assert s.api is not None and s.req is not None and isinstance(s.model, Model)
    bound = bound_input(s.api, s.req, s.model)
    assert bound is not None
    return bound


def tokenizer_runs(gw: Gateway) -> float:
    """How many times a prompt was counted with the tokenizer (its latency histogram)."""
    for metric in gw.metrics.tokenize_seconds.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0


async def test_unaudited_requests_are_billed_the_engines_figure_without_a_count() -> None:
    """Not audited: the prompt is never tokenized; the engine's figure under the bound is
    billed and the rest of the bound refunded."""
    gw, lim = gateway(1_000_000, audit=1000)
    first, _ = await request(gw, 1)
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact)
    before, runs = await tpm_value(lim, first), tokenizer_runs(gw)
    second, _ = await request(gw, 2)
    assert second.s.input_pending
    await complete_json(second, exact - 3)  # the engine counts a little differently
    assert tokenizer_runs(gw) == runs
    assert await tpm_value(lim, second) == 2 * before - 3


@pytest.mark.parametrize("reported", [None, 0, 10**6])
async def test_no_or_implausible_engine_figures_are_checked_against_a_count(
    reported: int | None,
) -> None:
    """No input figure, one far below the bound or one above it: the exact count is taken at
    settlement and bounds the figure as for any counted request."""
    gw, lim = gateway(1_000_000, audit=1000)
    _, exact, before = await first_request(gw, lim)
    second, _ = await request(gw, 2)
    assert second.s.input_pending
    await complete_json(second, reported)
    assert second.s.cost is not None and second.s.cost.input_tokens == exact
    charged = await tpm_value(lim, second) - before
    figure = second.s.input_tokens()
    if reported is None:  # an incomplete usage: the reservation stands, on the exact input
        assert figure == exact and charged == exact + 10
        return
    assert charged == figure + 5
    assert exact * 0.75 - 16 <= figure <= exact * 1.25 + 64  # bounded as counted


async def test_an_unaudited_stream_cut_at_its_limit_reports_the_exact_figure() -> None:
    """Stale hints let a stream in on its bound near the limit (another replica used the
    room): it may be cut early, never late; the cut message's figure and the bill use the
    exact input count, never the bound."""
    gw, lim = gateway(1_000_000, audit=1000)
    first, _ = await request(gw, 1)
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact)
    [tpm] = [b for b in first.s.buckets if b.kind == "tpm"]
    bound = prompt_bound(first)
    start = tpm.limit.limit - bound - 8  # room for the bound and 8 tokens
    lim.inner.seed_counter(tpm.key, start)
    proc, resp = await request(gw, 2, stream=True)
    assert resp.WhichOneof("response") == "request_body" and proc.s.input_pending
    await proc.handle(
        pb.ProcessingRequest(
            response_headers=headers({":status": "200", "content-type": "text/event-stream"})
        )
    )
    got: list[Any] = []
    for i in range(40):
        got += await feed(proc, event(f" w{i}"))
        if proc.s.life.ended:
            break
    assert proc.s.life.ended and not proc.s.input_pending
    cut = b"".join(
        r.response_body.response.body_mutation.streamed_response.body
        for r in got
        if r.WhichOneof("response") == "response_body"
    )
    used = int(cut.split(b", used ")[1].split(b".")[0])
    proc.close(Closed.EOF)
    await settled(gw)
    assert proc.driver is not None
    delivered = proc.driver.meter.delivered
    assert proc.s.cost is not None and proc.s.cost.input_tokens == exact
    assert await tpm_value(lim, proc) == start + exact + delivered == used
    assert used <= tpm.limit.limit


async def test_a_stream_is_admitted_on_its_bound_only_with_room_for_its_output() -> None:
    """A stream whose whole output would not fit beside headroom x its bound is counted
    first: its own cut never comes earlier because of the bound."""
    gw, lim = gateway(1_000_000, audit=1000)
    first, _ = await request(gw, 1)
    await complete_json(first, first.s.cost.input_tokens if first.s.cost else 0)
    [tpm] = [b for b in first.s.buckets if b.kind == "tpm"]
    bound = prompt_bound(first)
    near = tpm.limit.limit - 4 * bound - 5  # room for 4 x the bound, not for 10 more tokens
    gw.room.note(lim.admits[0], (near,) * len(lim.admits[0]))
    lim.inner.seed_counter(tpm.key, near)
    proc, _ = await request(gw, 2, stream=True)
    assert not proc.s.input_pending and admissions(gw, "bound") == 0
    gw.room.note(lim.admits[0], (near - 5,) * len(lim.admits[0]))
    lim.inner.seed_counter(tpm.key, near - 5)
    proc, _ = await request(gw, 3, stream=True)
    assert proc.s.input_pending and admissions(gw, "bound") == 1


async def test_an_answer_without_usage_keeps_the_reservation_on_the_exact_input() -> None:
    """A JSON answer without usage: the output reservation stands, as for a counted request,
    and the input is corrected from the bound to its count."""
    gw, lim = gateway(1_000_000, audit=1000)
    _, exact, before = await first_request(gw, lim)
    second, _ = await request(gw, 2)
    assert second.s.input_pending
    await complete_json(second, None, usage=False)
    assert await tpm_value(lim, second) - before == exact + 10  # input + max_tokens


async def test_a_count_that_fails_keeps_the_bound_and_says_so() -> None:
    """Should the exact count fail, the request is billed its bound (an over-count, never an
    under-count) and settlement logs it as an error."""
    gw, lim = gateway(1_000_000, audit=1000)
    first, exact, before = await first_request(gw, lim)
    bound = prompt_bound(first)
    second, _ = await request(gw, 2)
    assert second.s.input_pending

    def broken() -> int:
        raise RuntimeError("tokenizer gone")

    second.s.count_input_with(broken)
    assert second.s.input_figure() == bound  # a figure needed at once (a cut, the metadata)
    with structlog.testing.capture_logs() as logs:
        await complete_json(second, None, usage=False)
    assert second.s.count_failed and exact < bound
    assert second.s.cost is not None and second.s.cost.input_tokens == bound
    assert await tpm_value(lim, second) - before == bound + 10
    assert any(e["event"] == "input_count_failed" and e["log_level"] == "error" for e in logs)


def test_the_floor_follows_from_the_tokenizers_longest_token() -> None:
    """The floor is read from the encoding's vocabulary (cl100k_base's longest token is a run
    of 128 spaces), and a text of that token repeated reaches it."""
    longest = max(len(t) for t in bundled_encoding().token_byte_values())
    bound = UTF8BoundCounter(EXACT)
    assert bound.longest_token_bytes == EXACT.longest_token_bytes == longest == 128
    spaces = " " * (longest * 10)
    assert bound.fewest_tokens(bound.count(spaces)) <= EXACT.count(spaces) <= 11


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.lists(texts, max_size=3))
def test_the_floor_is_never_above_the_count(text: str, more: list[str]) -> None:
    """Whatever the text (and with forced cuts), the fewest tokens the bound allows is at most
    the exact count, for single texts and whole requests of every API."""
    for counter in (EXACT, CUT):
        bound = UTF8BoundCounter(counter)
        assert bound.fewest_tokens(bound.count(text)) <= counter.count(text)
    limits = RequestLimits(max_tokens_ceiling=1_000_000, max_n=16)
    bound = UTF8BoundCounter(EXACT)
    for path, body in _bodies(text, more, []).items():
        api = api_for_path(path)
        assert api is not None
        try:
            req = api.parse(orjson.dumps(body), limits)
        except GatewayError:
            continue
        walked = api.count_input(req, bound, SPEC)
        assert bound.fewest_tokens(walked) <= api.count_input(req, EXACT, SPEC), path


def shortcut_stops(gw: Gateway, model: str = "m") -> float:
    return float(gw.metrics.input_shortcut_stops.labels(model)._value.get())


async def test_an_upstream_whose_audited_figure_is_low_loses_the_shortcut() -> None:
    """An upstream reporting a sixth of the prompt (uncached tokens only, another tokenizer):
    the audit bills the count and stops the shortcut for the model, so its next
    unaudited requests are counted and billed as counted, not at the upstream's figure."""
    gw, lim = gateway(1_000_000, audit=2)
    first, exact, before = await first_request(gw, lim)
    low = exact // 6
    assert prompt_bound(first) / 32 <= low  # believed by a share-of-the-bound floor
    fair = exact  # what the counted path bills for a figure below its bounds: the count

    second, _ = await request(gw, 2)  # not audited: the engine's figure, in range, is billed
    assert second.s.input_pending
    await complete_json(second, exact - 1)
    total = await tpm_value(lim, second)
    assert total == 2 * before - 1 and shortcut_stops(gw) == 0

    third, _ = await request(gw, 3)  # audited: counted, the low figure disagrees
    await complete_json(third, low)
    assert third.s.input_tokens() == fair
    assert await tpm_value(lim, third) - total == fair + 5
    assert shortcut_stops(gw) == 1 and gw.input_audits.stopped("m")
    total = await tpm_value(lim, third)

    runs = tokenizer_runs(gw)
    for n in (4, 5):  # one would be sampled, one not: both are counted now
        proc, _ = await request(gw, n)
        await complete_json(proc, low)
        assert proc.s.input_tokens() == fair
        assert await tpm_value(lim, proc) - total == fair + 5
        total = await tpm_value(lim, proc)
    assert tokenizer_runs(gw) == runs + 2
    assert shortcut_stops(gw) == 1  # counted once per model


def test_stopped_models_are_bounded() -> None:
    """Past its size the table stops every model's shortcut instead of growing."""
    audits = InputAudits(max_models=2)
    assert audits.disagreed("a") and audits.disagreed("b") and not audits.disagreed("a")
    assert not audits.stopped("c")
    assert audits.disagreed("c")
    assert len(audits) == 2 and audits.stopped("c") and audits.stopped("anything")
    assert audits.count_now("anything", 1_000)


LARGE = PROMPT * 25  # 22,500 characters: counted in a worker thread at admission


@pytest.mark.parametrize(
    "ending", ["no_prompt_figure", "zero_figure", "upstream_error", "cut", "done"]
)
async def test_a_large_prompts_count_never_runs_on_the_event_loop(
    ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large prompt admitted on its bound and not audited, whose figure then needs the exact
    count (a JSON answer without an input figure or with one out of range, an upstream error's
    access log, a stream's quota cut, a stream ending without usage): the count runs in a
    worker thread, never in the event loop's, and the figures use it."""
    gw, lim = gateway(1_000_000, audit=1000)
    first, _ = await request(gw, 1, prompt=LARGE)  # counted first: the room hints
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact)
    before = await tpm_value(lim, first)
    loop_thread = threading.get_ident()
    threads: list[int] = []
    plain = TiktokenCounter.count

    def watched(self: TiktokenCounter, text: str) -> int:
        if len(text) > 1000:  # the prompt (stream deltas are short)
            threads.append(threading.get_ident())
        return plain(self, text)

    monkeypatch.setattr(TiktokenCounter, "count", watched)
    stream = ending in ("cut", "done")
    if ending == "cut":  # room for the bound and 8 tokens: the stream is cut at its limit
        [tpm] = [b for b in first.s.buckets if b.kind == "tpm"]
        before = tpm.limit.limit - prompt_bound(first) - 8
        lim.inner.seed_counter(tpm.key, before)
    proc, _ = await request(gw, 2, stream=stream, prompt=LARGE)
    assert proc.s.input_pending and admissions(gw, "bound") == 1
    if ending in ("no_prompt_figure", "zero_figure"):
        await complete_json(proc, None if ending == "no_prompt_figure" else 0)
    elif ending == "upstream_error":
        await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "500", "content-type": "application/json"})
            )
        )
    else:
        await proc.handle(
            pb.ProcessingRequest(
                response_headers=headers({":status": "200", "content-type": "text/event-stream"})
            )
        )
        for i in range(40):
            await feed(proc, event(f" w{i}"))
            if proc.s.life.ended:
                break
        if ending == "done":
            assert not proc.s.life.ended
            await feed(proc, b"data: [DONE]\n\n", end=True)
    assert not proc.s.input_pending  # the access log's figure needed the count: it was taken
    proc.close(Closed.EOF)
    await settled(gw)
    assert threads and loop_thread not in threads
    assert not proc.s.count_failed
    assert proc.s.cost is not None and proc.s.cost.input_tokens == exact
    delivered = proc.driver.meter.delivered if proc.driver is not None else 0
    billed = {
        "no_prompt_figure": exact + 10,  # no usage read: the reservation stands
        "zero_figure": exact + 5,  # below the count's bounds: the count, as counted
        "upstream_error": 0,  # an upstream error costs nothing
        "cut": exact + delivered,
        "done": exact + delivered,  # no usage: the input counted, the output delivered
    }[ending]
    assert await tpm_value(lim, proc) == before + billed


async def test_a_counted_first_request_contradicting_its_upstream_stops_the_shortcut() -> None:
    """A request counted first (no hint yet) whose upstream figure a count contradicts stops
    the shortcut as an audit would: the next one, admitted on the bound, is counted."""
    gw, lim = gateway(1_000_000, audit=1000)
    first, _ = await request(gw, 1)
    exact = first.s.cost.input_tokens if first.s.cost else 0
    await complete_json(first, exact // 6)
    assert not first.s.counted_after_bound and shortcut_stops(gw) == 1
    runs, before = tokenizer_runs(gw), await tpm_value(lim, first)
    second, _ = await request(gw, 2)
    assert admissions(gw, "bound") == 1
    await complete_json(second, exact // 6)
    assert tokenizer_runs(gw) == runs + 1
    fair = exact  # below the counted path's bounds: the count
    assert second.s.input_tokens() == fair
    assert await tpm_value(lim, second) - before == fair + 5
