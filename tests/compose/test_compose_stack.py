"""compose/ for real: images built, ``docker compose up`` (Redis, two ext_proc replicas, the
simulator, Envoy), the README's SDK checks through the published port, one replica stopped and
started under load with no failed request, and ``down -v`` leaving nothing behind.

The keys are config/demo.yaml's (the file compose/ mounts): ``sk-demo-standard`` (600 RPM,
200,000 TPM) and ``sk-demo-tight`` (5 RPM, 2,000 TPM). The tests share one project and run in
file order; the last one takes it down.
"""

from __future__ import annotations

import asyncio
import threading
import time

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from extproc.bench.rolling import Outcome, steady_load
from tests.compose.conftest import ComposeProject, docker, wait_for

pytestmark = pytest.mark.compose

STANDARD = "sk-demo-standard"
TIGHT = "sk-demo-tight"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _openai(p: ComposeProject, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _anthropic(p: ComposeProject, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=p.base_url, api_key=key, max_retries=0, timeout=60)


def test_every_service_runs_healthy_with_two_extproc_replicas(project: ComposeProject) -> None:
    """After ``up --wait``: redis, sim, envoy and two extproc containers, each healthy."""
    ps = project.run("ps", "--format", "{{.Name}}").split()
    expected = {
        project.container("redis"),
        project.container("sim"),
        project.container("envoy"),
        project.container("extproc", 1),
        project.container("extproc", 2),
    }
    assert set(ps) == expected
    for name in expected:
        assert project.healthy(name), (name, project.state(name))


def test_chat_completion_is_admitted_with_rate_limit_headers(project: ComposeProject) -> None:
    """A non-streaming chat completion with the standard key: 200, usage, x-ratelimit headers."""
    raw = _openai(project, STANDARD).chat.completions.with_raw_response.create(
        model="sim-small", max_tokens=20, messages=MESSAGES
    )
    r = raw.parse()
    assert r.usage is not None and r.usage.completion_tokens == 20
    assert r.choices[0].message.content
    assert raw.headers["x-ratelimit-limit-requests"] == "600"
    assert int(raw.headers["x-ratelimit-remaining-requests"]) < 600


#: The simulator's per-request latency controls: 1 ms between tokens keeps a 1,024-token stream
#: near a second, so the tight key's whole sequence fits in one minute window.
FAST = {"x-sim-ttft-ms": "5", "x-sim-itl-ms": "1"}


def _start_of_roomy_window(room_s: float = 20.0) -> None:
    """Windows are fixed and aligned to the epoch (docs/semantics.md): when fewer than
    ``room_s`` seconds are left in this minute, wait for the next one, so that a sequence meant to
    exhaust one window does not straddle two."""
    left = 60.0 - time.time() % 60.0
    if left < room_s:
        time.sleep(left + 0.5)


def test_tight_key_stream_completes_then_is_cut_then_429(project: ComposeProject) -> None:
    """The README's loop on the tight key, in one minute window: a full stream, a stream cut near
    2,000 TPM (the SDK raises the error event), then a 429 naming the tokens limit with a
    retry-after (at most one small request later: allowances held at the cut come back), on the
    Chat Completions API and on /v1/messages (anthropic.RateLimitError)."""
    c = _openai(project, TIGHT)
    _start_of_roomy_window()
    chunks = list(
        c.chat.completions.create(
            model="sim-small",
            max_tokens=1024,
            stream=True,
            messages=MESSAGES,
            extra_headers=FAST,
        )
    )
    pieces = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) == 1024  # the simulator streams one token per chunk
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    got: list[str] = []
    # a ~200-token prompt: the first stream left ~965 tokens, so this one passes the limit by
    # ~250, well beyond a lazy stream's overshoot bound (2N = 64): it is cut whether its
    # charges are drawn from local allowances (the default) or made in Redis (with "hi" alone
    # it would pass the limit by ~60, at the bound's edge, and might end before the cut)
    long_prompt: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi " * 200}]
    with pytest.raises(openai.APIError) as cut:
        for chunk in c.chat.completions.create(
            model="sim-small",
            max_tokens=1024,
            stream=True,
            messages=long_prompt,
            extra_headers=FAST,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    assert not isinstance(cut.value, openai.APIStatusError)  # mid-stream, not a refusal
    assert "tokens per minute" in cut.value.message and "stopped" in cut.value.message
    assert 0 < len(got) < 1024
    # Local allowances (on by default): the cut can come while the replicas still hold a little
    # of the window pre-debited for them (the counter Redis judges by includes it); what nobody
    # draws from goes back within AIQ_ALLOWANCE_TTL_MS (2 s) plus the sweeper's tick (0.5 s), a
    # time bound with no event to wait on from outside the replicas.  Past it, the room left is
    # the tenant's own: one more small request may fit before the tokens limit refuses, and near
    # the limit no replica takes an allowance again, so the refusals then hold.  The plan's 5
    # requests a minute leave three after the two streams: the refusal must come by then and
    # name the tokens limit, not the requests one.
    time.sleep(3.0)
    refused: openai.RateLimitError | None = None
    for _ in range(3):
        try:
            c.chat.completions.create(model="sim-small", max_tokens=20, messages=MESSAGES)
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None, "no 429 after the cut"
    assert refused.status_code == 429
    assert "tokens per minute" in refused.message, refused.message
    assert int(refused.response.headers["retry-after"]) > 0
    with pytest.raises(anthropic.RateLimitError) as refused_messages:
        _anthropic(project, TIGHT).messages.create(
            model="sim-small", max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )
    assert int(refused_messages.value.response.headers["retry-after"]) > 0


def test_responses_api_is_admitted(project: ComposeProject) -> None:
    """The Responses API with the standard key: usage as the simulator produced it."""
    r = _openai(project, STANDARD).responses.create(
        model="sim-small", input="hi", max_output_tokens=20
    )
    assert r.usage is not None and r.usage.output_tokens == 20
    assert r.output_text


def test_anthropic_messages_stream_is_admitted(project: ComposeProject) -> None:
    """Anthropic Messages, streamed, with the standard key: the final message has its usage."""
    with _anthropic(project, STANDARD).messages.stream(
        model="sim-small", max_tokens=30, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert final.usage.output_tokens == 30


class Load:
    """Steady load (half streaming) on a background event loop, until stopped."""

    def __init__(self, url: str, key: str, concurrency: int, max_tokens: int) -> None:
        self.outcomes: list[Outcome] = []
        self._in_flight = [0]
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._args = (url, key, concurrency, max_tokens)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        url, key, concurrency, max_tokens = self._args

        async def main() -> None:
            await steady_load(
                url,
                key,
                concurrency=concurrency,
                stop=self._stop,
                out=self.outcomes,
                in_flight=self._in_flight,
                max_tokens=max_tokens,
            )

        try:
            self._loop.run_until_complete(main())
        finally:
            self._loop.close()

    def start(self) -> Load:
        """Start the clients."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Let every client finish its request, then stop."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=90)
        assert not self._thread.is_alive(), "load clients did not stop"

    def ended_after(self, t: float) -> int:
        """Requests that started at or after monotonic time ``t`` and have ended."""
        return sum(1 for o in list(self.outcomes) if o.started >= t)


def test_replica_stop_and_start_under_load_fails_no_request(project: ComposeProject) -> None:
    """One ext_proc replica stopped (SIGTERM drain) and started again while 4 clients stream
    and post: 0 failed requests before, while it drains, while it is gone and after it is back;
    it exits 0 (drained, not killed) and is healthy again."""
    victim = project.container("extproc", 2)
    started_before = project.state(victim)["StartedAt"]
    load = Load(f"{project.base_url}/v1", STANDARD, concurrency=4, max_tokens=60).start()
    try:
        t0 = time.monotonic()
        wait_for("20 requests before the stop", lambda: load.ended_after(t0) >= 20, 60)
        fault_at = time.monotonic()
        docker("stop", victim, timeout=120)  # SIGTERM; compose's stop_grace_period applies
        gone_at = time.monotonic()
        state = project.state(victim)
        assert state["Status"] == "exited" and state["ExitCode"] == 0, state
        wait_for(
            "20 requests while the replica is gone", lambda: load.ended_after(gone_at) >= 20, 60
        )
        docker("start", victim)
        wait_for("the restarted replica to be healthy", lambda: project.healthy(victim), 120)
        back_at = time.monotonic()
        wait_for("20 requests after the restart", lambda: load.ended_after(back_at) >= 20, 60)
    finally:
        load.stop()
    assert project.state(victim)["StartedAt"] != started_before
    phases = {"before": 0, "fault": 0, "gone": 0, "back": 0}
    for o in load.outcomes:
        if o.started < fault_at:
            phases["before"] += 1
        elif o.started < gone_at:
            phases["fault"] += 1
        elif o.started < back_at:
            phases["gone"] += 1
        else:
            phases["back"] += 1
    failed = [o for o in load.outcomes if not o.ok]
    summary = f"{len(load.outcomes)} requests by phase {phases}; failed: {failed[:10]}"
    print(summary)
    assert failed == [], summary
    assert all(n > 0 for n in phases.values()), summary


def test_down_removes_every_container_network_and_volume(project: ComposeProject) -> None:
    """``docker compose down -v`` leaves no container, network or volume of the project."""
    before = project.leftovers()
    # redis, sim, two processors, envoy, and the one-shot credentials container (exited)
    assert len(before["containers"]) == 6, before
    # the network; Redis's data and the credentials the one-shot service made
    assert len(before["networks"]) == 1 and len(before["volumes"]) == 2, before
    project.run("down", "--volumes", "--remove-orphans", "--timeout", "30", timeout=180)
    after = project.leftovers()
    assert after == {"containers": [], "networks": [], "volumes": []}, after
