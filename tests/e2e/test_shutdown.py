"""SIGTERM's deadline: streams still running when the shutdown grace ends are cut with the
``server_shutdown`` error event (then the response is aborted), and settled for what was delivered
(docs/semantics.md, docs/operations.md "Draining")."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from extproc.stack import Stack
from tests.e2e.conftest import client, make_stack
from tests.helpers import settled

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a very long story."}]
#: 1,000 tokens at 40 ms each: the stream runs ~40 s, far beyond notice + grace (1.2 s)
SLOW = {"x-sim-itl-ms": "40"}
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def short_grace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose processor drains with a 0.2 s notice and a 1 s grace."""
    s = make_stack(
        Path(tmp_path_factory.mktemp("shutdown")),
        extproc_env={"AIQ_DRAIN_NOTICE_S": "0.2", "AIQ_SHUTDOWN_GRACE_S": "1"},
    )
    yield s
    s.stop()


def _sdk_stream(stack: Stack, out: dict[str, object], started: threading.Event) -> None:
    got = 0
    try:
        for ch in client(stack, "sk-drain").chat.completions.create(
            model="sim-small",
            messages=MSG,
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_headers=SLOW,
        ):
            if ch.choices and ch.choices[0].delta.content:
                got += 1
                out["got"] = got
                if got == 20:
                    started.set()
    except openai.APIError as exc:
        out["error"] = exc
    out["got"] = got


def _raw_stream(stack: Stack, out: dict[str, object], started: threading.Event) -> None:
    lines: list[str] = []
    body = {"model": "sim-small", "messages": MSG, "max_tokens": MAX_TOKENS, "stream": True}
    headers = {"authorization": "Bearer sk-std", **SLOW}
    try:
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST", f"{stack.base_url}/chat/completions", json=body, headers=headers
            ) as r,
        ):
            out["status"] = r.status_code
            for line in r.iter_lines():
                lines.append(line)
                if sum(1 for x in lines if x.startswith("data: {")) == 20:
                    started.set()
    except httpx.RemoteProtocolError as exc:
        out["aborted"] = exc
    out["lines"] = lines


def _content(event: str) -> str:
    """The text of one chat.completion.chunk event (``data: {...}``), empty for others."""
    doc = orjson.loads(event.removeprefix("data: "))
    choices = doc.get("choices") or [{}]
    return str(choices[0].get("delta", {}).get("content") or "")


def test_streams_open_at_the_deadline_are_cut_with_server_shutdown_and_settled(
    short_grace: Stack,
) -> None:
    """Two streams outlive the 1 s grace: each ends with the `server_shutdown` error event, no
    `data: [DONE]`, then an aborted response; the openai SDK raises it, and each tenant is charged input plus what it got."""
    rds = redis.Redis(port=short_grace.ports.redis, decode_responses=True)
    prompt = client(short_grace, "sk-closed").chat.completions.create(
        model="sim-small", messages=MSG, max_tokens=1
    )
    assert prompt.usage is not None
    # what the gateway charges for this prompt (its own input count), the same for every stream
    input_charge = settled(rds, "t-closed") - prompt.usage.completion_tokens
    assert input_charge >= prompt.usage.prompt_tokens
    sdk: dict[str, object] = {}
    raw: dict[str, object] = {}
    s1, s2 = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=_sdk_stream, args=(short_grace, sdk, s1)),
        threading.Thread(target=_raw_stream, args=(short_grace, raw, s2)),
    ]
    for t in threads:
        t.start()
    assert s1.wait(30) and s2.wait(30)
    proc = short_grace.proc("extproc0")
    proc.popen.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert proc.popen.wait(20) == 0
    assert proc.log_path is not None
    log = proc.log_path.read_text()
    assert '"streams_cut_at_shutdown"' in log and '"count":2' in log

    # the SDK raises the error event, after part of the answer
    err = sdk.get("error")
    assert isinstance(err, openai.APIError), sdk
    assert "restarting" in err.message
    got = int(str(sdk["got"]))
    assert 20 <= got < MAX_TOKENS

    # on the wire: content, then the server_shutdown error event (event: error) as the last
    # event, no [DONE], and the response aborted rather than ended
    assert raw["status"] == 200
    assert isinstance(raw.get("aborted"), httpx.RemoteProtocolError), raw.get("aborted")
    lines = raw["lines"]
    assert isinstance(lines, list)
    events = [x for x in lines if x.startswith("data: ")]
    assert "data: [DONE]" not in events
    assert '"code":"server_shutdown"' in events[-1].replace(" ", ""), events[-3:]
    assert "event: error" in lines
    chunks = [e for e in events[:-1] if _content(e)]
    assert 20 <= len(chunks) < MAX_TOKENS

    # settled for what was delivered: the prompt and the tokens received, not the reservation
    for tenant, delivered in (("t-drain", got), ("t-std", len(chunks))):
        used = settled(rds, tenant)
        assert abs(used - (input_charge + delivered)) <= 1, (tenant, used, input_charge, delivered)
