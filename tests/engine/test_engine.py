"""Bills against a real engine: vLLM's own /metrics is the ground truth for every API.

For completed requests the tenant's counters must rise by exactly what the engine computed
(``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``). For cut streams the bill is
what was delivered (the engine's prompt plus the tokens the client received, counted with the
engine's own per-token logprobs), the engine's excess (generated - delivered) is bounded, and
strict mode delivers at least 99 % of the limit by the engine's count, never more.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
import redis
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from tokenizers import Tokenizer

from extproc.bench.vllm import (
    EXACT16_NAME,
    EXACT_NAME,
    RUN_AHEAD_BOUND,
    SERVED_NAME,
    Engine,
    EngineMetrics,
    tokens_billed,
    wait_idle,
    wait_metrics,
    wait_settled,
)
from extproc.stack import Stack

pytestmark = pytest.mark.engine

MSG: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a long story about quotas."}
]
AMSG: list[MessageParam] = [{"role": "user", "content": "Tell me a long story about quotas."}]


def oai(gateway: Stack, key: str) -> openai.OpenAI:
    """The openai SDK through Envoy (no retries)."""
    return openai.OpenAI(base_url=gateway.base_url, api_key=f"sk-{key}", max_retries=0, timeout=60)


def aoai(gateway: Stack, key: str) -> openai.AsyncOpenAI:
    """The async openai SDK through Envoy (no retries)."""
    return openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key=f"sk-{key}", max_retries=0, timeout=120
    )


def claude(gateway: Stack, key: str) -> anthropic.Anthropic:
    """The anthropic SDK through Envoy (no retries)."""
    return anthropic.Anthropic(
        base_url=gateway.base_url.removesuffix("/v1"),
        api_key=f"sk-{key}",
        max_retries=0,
        timeout=60,
    )


def access_log(gateway: Stack, tenant: str, want: int = 1) -> list[dict[str, Any]]:
    """Envoy's access-log lines of ``tenant`` (the gateway's per-request figures), waiting up
    to 3 s for ``want`` of them (Envoy flushes its log every 250 ms)."""
    deadline = time.monotonic() + 3
    while True:
        out = []
        for line in (gateway.workdir / "envoy0.log").read_text(errors="replace").splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("tenant") == tenant:
                    out.append(rec)
        if len(out) >= want or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


@dataclass
class Measured:
    """One scenario's bill and the engine's figures over it."""

    billed: int
    engine: EngineMetrics
    reported: list[tuple[int, int]]  # (prompt, completion) usage each response reported

    def explain(self, gateway: Stack, tenant: str) -> str:
        """Figures for an assertion message."""
        gw = [
            (r.get("input_tokens"), r.get("output_tokens"), r.get("ending"))
            for r in access_log(gateway, tenant, len(self.reported))
        ]
        return (
            f"billed {self.billed}; engine prompt {self.engine.prompt_tokens} + generation "
            f"{self.engine.generation_tokens} = {self.engine.tokens}; responses reported "
            f"{self.reported}; gateway (input, output, ending) {gw}"
        )


def measure(
    engine: Engine, grds: redis.Redis, tenant: str, run: Callable[[], list[tuple[int, int]]]
) -> Measured:
    """Run ``run`` (returns each response's reported usage) between two idle engine scrapes and
    wait for the tenant's settlements."""
    before = wait_idle(engine.metrics_url)
    reported = run()
    billed = wait_settled(grds, f"e-{tenant}")
    after = wait_idle(engine.metrics_url)
    return Measured(billed, after - before, reported)


def check_exact(m: Measured, gateway: Stack, tenant: str) -> None:
    """The bill equals the engine's count, and the engine's count is what the API reported."""
    assert m.engine.tokens == sum(p + c for p, c in m.reported), m.explain(gateway, f"e-{tenant}")
    assert m.billed == m.engine.tokens, m.explain(gateway, f"e-{tenant}")


IGNORE_EOS: dict[str, Any] = {"ignore_eos": True}


# -- completed requests: every API, streams and not ----------------------------------------


@pytest.mark.parametrize(
    ("model", "suffix"),
    [(SERVED_NAME, ""), (EXACT_NAME, "exact"), (EXACT16_NAME, "exact16")],
)
def test_chat_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis, model: str, suffix: str
) -> None:
    """Chat completions, not streamed (on the JSON path, and on the exact path: sent as a
    stream, JSON rebuilt): the counters rise by the engine's prompt + generation."""
    key = f"chat{suffix}"
    c = oai(gateway, key)

    def run() -> list[tuple[int, int]]:
        r = c.chat.completions.create(
            model=model,
            messages=MSG,
            max_tokens=60,
            extra_body=IGNORE_EOS,
        )
        assert r.usage is not None and r.choices[0].message.content
        return [(r.usage.prompt_tokens, r.usage.completion_tokens)]

    check_exact(measure(engine, grds, key, run), gateway, key)


def test_chat_stream_bill_equals_engine(engine: Engine, gateway: Stack, grds: redis.Redis) -> None:
    """Chat completions streamed (usage asked for): the counters rise by the engine's count;
    the per-token logprobs the cut tests count deliveries with add up to that count too."""
    c = oai(gateway, "chatstream")

    def run() -> list[tuple[int, int]]:
        out = []
        for max_tokens, logprobs in ((300, True), (200, False)):
            usage = None
            text = ""
            entries = 0
            for ch in c.chat.completions.create(
                model=SERVED_NAME,
                messages=MSG,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=logprobs,
                extra_body=IGNORE_EOS,
            ):
                if ch.choices and ch.choices[0].delta.content:
                    text += ch.choices[0].delta.content
                entries += _tokens_in(ch)
                if ch.usage is not None:
                    usage = ch.usage
            assert usage is not None and text
            assert usage.completion_tokens == max_tokens
            assert entries == (max_tokens if logprobs else 0)
            out.append((usage.prompt_tokens, usage.completion_tokens))
        return out

    check_exact(measure(engine, grds, "chatstream", run), gateway, "chatstream")


@pytest.mark.parametrize(
    ("model", "suffix"),
    [(SERVED_NAME, ""), (EXACT_NAME, "exact"), (EXACT16_NAME, "exact16")],
)
def test_completions_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis, model: str, suffix: str
) -> None:
    """Legacy completions, not streamed (JSON path and exact path): the counters rise by the
    engine's count."""
    key = f"completions{suffix}"
    c = oai(gateway, key)

    def run() -> list[tuple[int, int]]:
        r = c.completions.create(
            model=model, prompt="Once upon a time", max_tokens=80, extra_body=IGNORE_EOS
        )
        assert r.usage is not None
        return [(r.usage.prompt_tokens, r.usage.completion_tokens)]

    check_exact(measure(engine, grds, key, run), gateway, key)


def test_completions_stream_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """Legacy completions streamed: the counters rise by the engine's count."""
    c = oai(gateway, "completionsstream")

    def run() -> list[tuple[int, int]]:
        usage = None
        for ch in c.completions.create(
            model=SERVED_NAME,
            prompt="Once upon a time",
            max_tokens=250,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        ):
            if ch.usage is not None:
                usage = ch.usage
        assert usage is not None
        return [(usage.prompt_tokens, usage.completion_tokens)]

    check_exact(measure(engine, grds, "completionsstream", run), gateway, "completionsstream")


@pytest.mark.parametrize(("model", "suffix"), [(SERVED_NAME, ""), (EXACT_NAME, "exact")])
def test_responses_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis, model: str, suffix: str
) -> None:
    """The Responses API, not streamed (JSON path and exact path): the counters rise by the
    engine's count."""
    key = f"responses{suffix}"
    c = oai(gateway, key)

    def run() -> list[tuple[int, int]]:
        r = c.responses.create(
            model=model, input="Tell me a story.", max_output_tokens=60, extra_body=IGNORE_EOS
        )
        assert r.usage is not None
        return [(r.usage.input_tokens, r.usage.output_tokens)]

    check_exact(measure(engine, grds, key, run), gateway, key)


def test_responses_stream_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """The Responses API streamed: the counters rise by the engine's count."""
    c = oai(gateway, "responsesstream")

    def run() -> list[tuple[int, int]]:
        usage = None
        text = ""
        for ev in c.responses.create(
            model=SERVED_NAME,
            input="Tell me a story.",
            max_output_tokens=200,
            stream=True,
            extra_body=IGNORE_EOS,
        ):
            if ev.type == "response.output_text.delta":
                text += ev.delta
            elif ev.type in ("response.completed", "response.incomplete"):
                usage = ev.response.usage
        assert usage is not None and text
        return [(usage.input_tokens, usage.output_tokens)]

    check_exact(measure(engine, grds, "responsesstream", run), gateway, "responsesstream")


@pytest.mark.parametrize(("model", "suffix"), [(SERVED_NAME, ""), (EXACT_NAME, "exact")])
def test_messages_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis, model: str, suffix: str
) -> None:
    """Anthropic Messages, not streamed (JSON path and exact path): the counters rise by the
    engine's count."""
    key = f"messages{suffix}"
    c = claude(gateway, key)

    def run() -> list[tuple[int, int]]:
        r = c.messages.create(model=model, max_tokens=60, messages=AMSG)
        return [(r.usage.input_tokens, r.usage.output_tokens)]

    check_exact(measure(engine, grds, key, run), gateway, key)


def test_messages_stream_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """Anthropic Messages streamed: the counters rise by the engine's count."""
    c = claude(gateway, "messagesstream")

    def run() -> list[tuple[int, int]]:
        with c.messages.stream(model=SERVED_NAME, max_tokens=200, messages=AMSG) as s:
            for _ in s.text_stream:
                pass
            final = s.get_final_message()
        return [(final.usage.input_tokens, final.usage.output_tokens)]

    check_exact(measure(engine, grds, "messagesstream", run), gateway, "messagesstream")


# -- kinds of output: words, code-like ASCII, CJK and emoji, byte tokens -------------------


def _is_cjk_or_emoji(ch: str) -> bool:
    o = ord(ch)
    return 0x3000 <= o <= 0x9FFF or 0xFF00 <= o <= 0xFFEF or o >= 0x1F000 or 0x2600 <= o <= 0x27BF


def token_ids(engine: Engine, kind: str) -> list[int]:
    """Token ids the engine may sample for an output of ``kind``: ``words`` (a space and ASCII
    letters), ``ascii`` (any printable ASCII: code, punctuation, word pieces), ``cjk`` (whole CJK
    characters or emoji), ``bytes`` (those and the tokens that are only part of a character's
    UTF-8 bytes, which decode to U+FFFD on their own)."""
    assert engine.model is not None
    tok = Tokenizer.from_file(str(engine.model / "tokenizer.json"))
    special = set(tok.get_vocab(with_added_tokens=True)) - set(
        tok.get_vocab(with_added_tokens=False)
    )
    ids = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if not text or tok.id_to_token(i) in special:
            continue
        partial = "\ufffd" in text
        if kind == "words":
            ok = text.startswith(" ") and text[1:].isascii() and text[1:].isalpha()
        elif kind == "ascii":
            ok = text.isascii() and text.isprintable()
        elif kind == "cjk":
            ok = not partial and any(_is_cjk_or_emoji(ch) for ch in text)
        else:
            ok = partial or any(_is_cjk_or_emoji(ch) for ch in text)
        if ok:
            ids.append(i)
    return ids


@pytest.mark.parametrize("kind", ["words", "ascii", "cjk", "bytes"])
def test_output_kinds_bill_equals_engine(
    engine: Engine, gateway: Stack, grds: redis.Redis, kind: str
) -> None:
    """Words, code-like ASCII, CJK and emoji (whole characters, then byte tokens too) streamed:
    the bill is the engine's count, whatever re-tokenising the text would give."""
    ids = token_ids(engine, kind)
    assert len(ids) > 50, len(ids)
    c = oai(gateway, kind)
    texts: list[str] = []

    def run() -> list[tuple[int, int]]:
        usage = None
        text = ""
        for ch in c.chat.completions.create(
            model=SERVED_NAME,
            messages=[
                {
                    "role": "user",
                    "content": "\u7528\u4e2d\u6587\u8bb2\u4e00\u4e2a\u6545\u4e8b \U0001f642",
                }
            ],
            max_tokens=300,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "allowed_token_ids": ids},
        ):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
            if ch.usage is not None:
                usage = ch.usage
        assert usage is not None
        texts.append(text)
        return [(usage.prompt_tokens, usage.completion_tokens)]

    m = measure(engine, grds, kind, run)
    if kind in ("cjk", "bytes"):
        assert any(_is_cjk_or_emoji(ch) for ch in texts[0]), texts[0][:200]
    check_exact(m, gateway, kind)


# -- cuts -------------------------------------------------------------------------------------


@dataclass
class CutStream:
    """What one stream delivered before it ended."""

    delivered: int  # tokens received, by the engine's own count (one logprobs entry per token)
    error: Exception | None
    finish_reason: str | None


def _tokens_in(ch: ChatCompletionChunk) -> int:
    n = 0
    for choice in ch.choices or []:
        lp = getattr(choice, "logprobs", None)
        if lp is not None and lp.content:
            n += len(lp.content)
    return n


def cut_stream(c: openai.OpenAI, max_tokens: int) -> CutStream:
    """A chat stream asking for per-token logprobs, read until it ends or errors."""
    delivered = 0
    finish = None
    try:
        for ch in c.chat.completions.create(
            model=SERVED_NAME,
            messages=MSG,
            max_tokens=max_tokens,
            stream=True,
            logprobs=True,
            extra_body=IGNORE_EOS,
        ):
            delivered += _tokens_in(ch)
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
    except openai.APIError as exc:
        return CutStream(delivered, exc, finish)
    return CutStream(delivered, None, finish)


async def acut_stream(c: openai.AsyncOpenAI, max_tokens: int) -> CutStream:
    """:func:`cut_stream` on the async client."""
    delivered = 0
    finish = None
    try:
        stream = await c.chat.completions.create(
            model=SERVED_NAME,
            messages=MSG,
            max_tokens=max_tokens,
            stream=True,
            logprobs=True,
            extra_body=IGNORE_EOS,
        )
        async for ch in stream:
            delivered += _tokens_in(ch)
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
    except openai.APIError as exc:
        return CutStream(delivered, exc, finish)
    return CutStream(delivered, None, finish)


def _after_cut(engine: Engine, before: EngineMetrics) -> EngineMetrics:
    """The engine's figures once its running-request gauge is back to 0 (it must be, soon)."""
    wait_metrics(engine.metrics_url, lambda m: m.running == 0 and m.waiting == 0, timeout=10)
    return wait_idle(engine.metrics_url) - before


@pytest.mark.parametrize(("kind", "limit"), [("cutlazy", 300), ("cutstrict", 300)])
def test_cut_bills_what_was_delivered(
    engine: Engine, gateway: Stack, grds: redis.Redis, kind: str, limit: int
) -> None:
    """A stream cut at the limit: the engine stops (running back to 0), the bill is the engine's
    prompt + the tokens delivered, the engine's excess is bounded; strict delivers >= 99 % of
    the limit by the engine's count and never more."""
    c = oai(gateway, kind)
    before = wait_idle(engine.metrics_url)
    s = cut_stream(c, 1000)
    assert isinstance(s.error, openai.APIError), s
    assert s.finish_reason is None
    delta = _after_cut(engine, before)
    billed = wait_settled(grds, f"e-{kind}")
    delivered_total = delta.prompt_tokens + s.delivered
    excess = delta.generation_tokens - s.delivered
    info = (
        f"billed {billed}; engine prompt {delta.prompt_tokens}, generated "
        f"{delta.generation_tokens}, delivered {s.delivered} (excess {excess}); "
        f"gateway {[(r.get('input_tokens'), r.get('output_tokens'), r.get('ending')) for r in access_log(gateway, f'e-{kind}')]}"
    )
    assert 0 < s.delivered < 1000, info
    assert 0 <= excess <= RUN_AHEAD_BOUND, info
    assert billed == delivered_total, info
    if kind == "cutstrict":
        assert 0.99 * limit <= delivered_total <= limit, info


@pytest.mark.parametrize(("kind", "limit"), [("conclazy", 1500), ("concstrict", 1500)])
def test_eight_concurrent_cut_streams(
    engine: Engine, gateway: Stack, grds: redis.Redis, kind: str, limit: int
) -> None:
    """Eight streams at once against a small limit: bills are what was delivered by the
    engine's count, each stream's excess is bounded, strict stays within [99 %, 100 %]."""
    before = wait_idle(engine.metrics_url)

    async def go() -> list[CutStream]:
        c = aoai(gateway, kind)
        try:
            return list(await asyncio.gather(*(acut_stream(c, 400) for _ in range(8))))
        finally:
            await c.close()

    streams = asyncio.run(go())
    delta = _after_cut(engine, before)
    billed = wait_settled(grds, f"e-{kind}")
    delivered = sum(s.delivered for s in streams)
    cut = [s for s in streams if s.error is not None]
    excess = delta.generation_tokens - delivered
    info = (
        f"billed {billed}; engine prompt {delta.prompt_tokens}, generated "
        f"{delta.generation_tokens}, delivered {delivered} {[s.delivered for s in streams]} "
        f"(excess {excess}); {len(cut)} cut; finished {delta.finished}"
    )
    assert cut, info
    assert 0 <= excess <= RUN_AHEAD_BOUND * len(cut), info
    assert billed == delta.prompt_tokens + delivered, info
    if kind == "concstrict":
        assert 0.99 * limit <= delta.prompt_tokens + delivered <= limit, info


def test_run_ahead_when_the_processor_lags(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """The processor freezes mid-stream: however long it lags, the engine computes at most the
    tenant's room plus the bound (vLLM does not pause for a client that stops reading, so no
    Envoy buffer limit can bound this: the budget forwarded to the engine has to), and the cut
    bills what was delivered."""
    limit = 100  # the lag100 plan
    c = oai(gateway, "lagging")
    before = wait_idle(engine.metrics_url)
    seen = {"delivered": 0}
    froze = threading.Event()
    ahead: dict[str, int] = {}
    target = {"generated": limit + RUN_AHEAD_BOUND}  # past room + bound whatever the prompt

    def freeze() -> None:
        # once 10 tokens arrived, freeze the processor until the engine has generated far past
        # the tenant's room, or for 3 s (well under Envoy's 5 s ext_proc message timeout: past
        # it the stream is reset), then thaw it
        deadline = time.monotonic() + 60
        while seen["delivered"] < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        gateway.signal("extproc0", signal.SIGSTOP)
        t0 = time.monotonic()
        froze.set()
        try:
            m = wait_metrics(
                engine.metrics_url,
                lambda m: m.generation_tokens - before.generation_tokens >= target["generated"],
                timeout=3,
            )
        except Exception:
            m = engine.metrics()
        finally:
            gateway.signal("extproc0", signal.SIGCONT)
        ahead["frozen_ms"] = round(1000 * (time.monotonic() - t0))
        ahead["generated"] = m.generation_tokens - before.generation_tokens
        ahead["running"] = m.running
        ahead["while_frozen"] = ahead["generated"] - seen["delivered"]

    t = threading.Thread(target=freeze, daemon=True)
    t.start()
    error: Exception | None = None
    try:
        for ch in c.chat.completions.create(
            model=SERVED_NAME,
            messages=MSG,
            max_tokens=1500,
            stream=True,
            logprobs=True,
            extra_body=IGNORE_EOS,
        ):
            seen["delivered"] += _tokens_in(ch)
    except openai.APIError as exc:
        error = exc
    t.join(10)
    assert froze.is_set()
    delta = _after_cut(engine, before)
    billed = wait_settled(grds, "e-lagging")
    excess = delta.generation_tokens - seen["delivered"]
    room = limit - delta.prompt_tokens
    info = (
        f"limit {limit}, billed {billed}; engine prompt {delta.prompt_tokens}, generated "
        f"{delta.generation_tokens}, delivered {seen['delivered']} (excess {excess}); while "
        f"frozen {ahead.get('frozen_ms')} ms the engine generated {ahead.get('generated')}, "
        f"{ahead.get('while_frozen')} ahead of delivery; error {error!r}"
    )
    if (
        ahead["generated"] < target["generated"]
        and ahead["running"]
        and (delta.generation_tokens <= room + RUN_AHEAD_BOUND)
    ):
        # the engine was still running but too slow on this machine to pass the room in 3 s
        pytest.skip(f"inconclusive: the engine generated too slowly to test the bound: {info}")
    assert isinstance(error, openai.APIError), info
    assert delta.generation_tokens <= room + RUN_AHEAD_BOUND, info
    assert 0 <= excess <= RUN_AHEAD_BOUND, info
    assert billed == delta.prompt_tokens + seen["delivered"], info


# -- a non-stream abandoned by its client ----------------------------------------------------


@dataclass
class Abandoned:
    """One non-stream the client gave up on after ``after_s``: what the engine computed for it
    (its /metrics) and what the gateway billed."""

    after_s: float
    prompt: int
    generated: int
    billed: int

    @property
    def billed_output(self) -> int:
        return self.billed - self.prompt

    def __str__(self) -> str:
        return (
            f"after {self.after_s} s: engine prompt {self.prompt}, generated {self.generated}; "
            f"billed {self.billed} (output {self.billed_output})"
        )


def abandon(
    engine: Engine,
    gateway: Stack,
    grds: redis.Redis,
    after_s: float,
    *,
    model: str = SERVED_NAME,
    key: str = "abandoned",
) -> Abandoned:
    """A chat non-stream asking for far more tokens than the engine makes in ``after_s``,
    whose client closes its connection at ``after_s`` (the SDK's timeout): Envoy resets the
    upstream request."""
    tenant = f"e-{key}"
    c = openai.OpenAI(
        base_url=gateway.base_url, api_key=f"sk-{key}", max_retries=0, timeout=after_s
    )
    before = wait_idle(engine.metrics_url)
    billed_before = tokens_billed(grds, tenant)
    try:
        with pytest.raises(openai.APITimeoutError):
            c.chat.completions.create(
                model=model, messages=MSG, max_tokens=1500, extra_body=IGNORE_EOS
            )
    finally:
        c.close()
    delta = _after_cut(engine, before)
    billed = wait_settled(grds, tenant) - billed_before
    return Abandoned(after_s, delta.prompt_tokens, delta.generation_tokens, billed)


#: How far an abandon on the JSON path may be billed from what the engine generated: the
#: learned rate is the median speed of the model's recent non-streams (of its streams when it
#: had too few: on this 2-core machine the CPU vLLM decodes a stream 10-17 % slower than a
#: non-stream, its per-token SSE work sharing the cores with the model), and the engine's
#: speed moves ~10 % from one request to the next. Measured errors with the streams' rate:
#: -17 % to +2 % over 15 abandons (docs/engine-tests.md); a constant rate (the old 200
#: default, or the 1,000 this test used to set) is off by 50 % or more. The issue's 2 % + 16
#: is the exact path's bound (below).
LEARNED_SHARE = 0.20
EXACT_SHARE = 0.02


def check_abandons(runs: list[Abandoned], share: float, extra: str = "") -> None:
    """Each abandon billed the engine's prompt and what it generated, within ``share`` of
    the generated tokens + 16."""
    info = "; ".join(str(r) for r in runs) + (f"; {extra}" if extra else "")
    print(info)
    for r in runs:
        assert r.prompt > 0, info
        assert 0 < r.generated < 1500, info  # it ran, and stopped when the client left
        assert abs(r.billed - (r.prompt + r.generated)) <= share * r.generated + 16, info


def test_an_abandoned_non_stream_bills_what_the_engine_generated(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """The default configuration (non-streams on the JSON path, no rate configured): the
    model's traffic first, six completed streams of 400 tokens (from which the gateway learns
    the model's time to start: admission to first chunk) then six completed non-streams of
    400 tokens, over which the engine's own decode speed is measured (its
    ``vllm:generation_tokens_total`` rise over their wall time) and from which the gateway
    learns the model's JSON decode rate (output per sequence over admission to end less the
    start); then a client that hangs up on a non-stream after 0.5, 1 and 2 s (vLLM aborts it
    when Envoy resets it, running back to 0).  The gateway, which saw no response, bills the
    input and the JSON rate for the time it ran after the learned start.  Asserted: the rate
    it billed at (its ``abandon_rate`` log line) is the engine's measured non-stream speed
    within 15 %; each bill is that rate times the abandon's time (after the start, up to
    0.25 s of settlement delay); and the bill is within 20 % + 16 tokens of what the engine
    generated unless the engine's speed moved by more than that between the teaching and
    the abandon (the exact path's test below holds 2 % + 16 whatever the engine does)."""
    c = oai(gateway, "abandoned")
    # the engine idle first, as for the abandons: the rate learned under another load (the
    # run-ahead test's request still decoding) is that load's (measured: 40 % under)
    wait_idle(engine.metrics_url)
    for _ in range(6):
        out = 0
        for ch in c.chat.completions.create(
            model=SERVED_NAME,
            messages=MSG,
            max_tokens=400,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        ):
            if ch.usage is not None:
                out = ch.usage.completion_tokens
        assert out == 400
    before = wait_idle(engine.metrics_url)
    t0 = time.monotonic()
    for _ in range(6):
        taught_by = c.chat.completions.create(
            model=SERVED_NAME, messages=MSG, max_tokens=400, extra_body=IGNORE_EOS
        )
        assert taught_by.usage is not None and taught_by.usage.completion_tokens == 400
    taught_s = time.monotonic() - t0
    taught = wait_idle(engine.metrics_url) - before
    engine_rate = taught.generation_tokens / taught_s
    wait_settled(grds, "e-abandoned")
    runs = [abandon(engine, gateway, grds, after) for after in (0.5, 1.0, 2.0)]
    lines = [
        json.loads(line)
        for path in gateway.workdir.glob("extproc*.log")
        for line in path.read_text(errors="replace").splitlines()
        if '"abandon_rate"' in line and '"e-abandoned"' in line
    ][-3:]
    info = (
        "; ".join(str(r) for r in runs)
        + f"; engine {engine_rate:.0f} tokens/s while teaching non-streams; billed at "
        + str([(x["tokens_per_second"], x["start_ms"], x["learned_from"]) for x in lines])
        + "; errors "
        + str([f"{(r.billed_output - r.generated) / r.generated:+.1%}" for r in runs])
    )
    print(info)
    assert len(lines) == 3, info
    for r, line in zip(runs, lines, strict=True):
        rate, start_s = line["tokens_per_second"], line["start_ms"] / 1000
        assert line["json"] is True and line["learned_from"] >= 5, info  # the JSON rate
        assert abs(rate - engine_rate) <= 0.15 * engine_rate, info
        assert r.prompt > 0 and 0 < r.generated < 1500, info
        billed_out = r.billed - r.prompt
        assert rate * (r.after_s - start_s) - 1 <= billed_out <= rate * (r.after_s + 0.25) + 1, info
        # the engine's own speed during the abandon, against the one it was learned at
        steady = abs(r.generated / max(r.after_s - start_s, 0.01) - engine_rate) <= (
            LEARNED_SHARE * engine_rate
        )
        if steady:
            assert abs(billed_out - r.generated) <= LEARNED_SHARE * r.generated + 16, info


def test_an_abandoned_exact_non_stream_bills_what_the_engine_generated(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """The exact path (``non_streams: exact``: the gateway sends the non-stream upstream as a
    stream with usage and keeps what passes): a client that hangs up after 0.5, 1 and 2 s is
    billed the engine's prompt and what it generated until then, within 2 % + 16 tokens (what
    was still on its way from the engine to the processor), with no rate involved."""
    check_abandons(
        [
            abandon(engine, gateway, grds, after, model=EXACT_NAME, key="abandonedexact")
            for after in (0.5, 1.0, 2.0)
        ],
        EXACT_SHARE,
    )


def test_an_abandoned_exact_non_stream_with_a_stream_interval_bills_what_the_engine_generated(
    engine: Engine, gateway: Stack, grds: redis.Redis
) -> None:
    """The exact path asking the engine for 16 tokens per chunk (``exact_stream_interval``:
    one ext_proc message per 16 tokens): an abandon at 0.5, 1 and 2 s leaves at most the 15
    tokens the engine generated but had not sent yet unseen, so the bill is still within 2 %
    + 16 tokens of the engine's prompt and generation."""
    check_abandons(
        [
            abandon(engine, gateway, grds, after, model=EXACT16_NAME, key="abandonedexact16")
            for after in (0.5, 1.0, 2.0)
        ],
        EXACT_SHARE,
    )
