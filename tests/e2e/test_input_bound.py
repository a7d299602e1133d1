"""Admission on a bound of the input through the real stack (Envoy, processor, Redis, the
simulator, the openai SDK): requests far from the limit are admitted on the bound and billed
the upstream's figures exactly; near a strict limit the prompt is counted first and nothing
goes over."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
import redis

from extproc.stack import Stack
from tests.e2e.conftest import client, make_stack
from tests.e2e.test_streaming import ENGINE_PROMPT, MSG, PROMPT
from tests.helpers import e2e_rules, settled

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The e2e stack with admission on a bound turned on (off by default)."""
    rules = e2e_rules()
    rules["requests"] = {**rules.get("requests", {}), "admit_on_bound": True}
    s = make_stack(Path(tmp_path_factory.mktemp("bound")), rules=rules)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rds(stack: Stack) -> Iterator[redis.Redis]:
    client = redis.Redis(port=stack.ports.redis, decode_responses=True)
    yield client
    client.close()


def decisions(stack: Stack, tenant: str) -> list[str]:
    """How each admitted request of ``tenant`` knew its input, from the processor's log
    (``before``: counted first; ``after``: admitted on the bound)."""
    path = stack.proc("extproc0").log_path
    assert path is not None
    out = []
    for line in path.read_bytes().splitlines():
        if not line.startswith(b"{"):
            continue
        ev = orjson.loads(line)
        if ev.get("event") == "decision" and ev.get("tenant") == tenant and "input_counted" in ev:
            out.append(ev["input_counted"])
    return out


def test_far_from_the_limit_requests_are_admitted_on_the_bound_and_billed_exactly(
    stack: Stack, rds: redis.Redis
) -> None:
    """The first request is counted first (nothing known of the counters yet); the next ones
    are admitted on the bound, and the counters hold exactly the upstream's figures."""
    c = client(stack, "sk-bound")
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=20)
    list(c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=20, stream=True))
    c.chat.completions.create(model="sim-small", messages=MSG, max_tokens=20)
    assert decisions(stack, "t-bound") == ["before", "after", "after"]
    assert settled(rds, "t-bound", expect=3) == 3 * (ENGINE_PROMPT + 20)


def test_near_a_strict_limit_the_prompt_is_counted_first_and_nothing_goes_over(
    stack: Stack, rds: redis.Redis
) -> None:
    """Strict streams until the limit refuses: the first ones go on the bound, those near the
    limit are counted first, none is refused for a bound, and what was billed, to the token
    (delivered output plus each prompt at the figure it was billed), never passes the limit."""
    c = client(stack, "sk-boundstrict")
    billed = refused = 0
    for _ in range(40):
        n, done = 0, False
        try:
            for ch in c.chat.completions.create(
                model="sim-small", messages=MSG, max_tokens=300, stream=True
            ):
                if ch.choices and ch.choices[0].delta.content:
                    n += 1
            done = True
        except openai.RateLimitError:
            refused += 1
            break
        except openai.APIError:
            pass  # cut by the limit: billed what it delivered, its prompt at the gateway's count
        billed += n + (ENGINE_PROMPT if done else PROMPT)
    assert refused == 1
    used = settled(rds, "t-boundstrict", expect=1)
    assert used == billed <= 4000
    how = decisions(stack, "t-boundstrict")
    assert how[0] == "before" and "after" in how and how[-1] == "before"
