"""The admin API on the real stack: a key created with ``ai-quota admin`` works through Envoy
with the openai SDK on both processor replicas (each replica's metrics show it served), and
each refuses it (401) once it is revoked.  The 1 s propagation bound is the bench's to measure
(``scripts/bench --only admin``), not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack import Stack, free_port, port_in_use
from tests.e2e.conftest import client, make_stack
from tests.helpers import e2e_rules, request_ledgers

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def admin_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int, Path]]:
    """Two replicas behind one Envoy, both serving the admin API on one port (SO_REUSEPORT)."""
    workdir = Path(tmp_path_factory.mktemp("admin"))
    token = workdir / "admin.token"
    token.write_text("e2e-admin-token\n")
    token.chmod(0o600)
    port = free_port()
    env = {
        "AIQ_ADMIN_PORT": str(port),
        "AIQ_ADMIN_TOKEN_FILE": str(token),
        "AIQ_REUSEPORT": "1",
    }
    metrics = free_port()
    while port_in_use(metrics + 1):  # replica i serves metrics on metrics + i
        metrics = free_port()
    s = make_stack(workdir, extprocs=2, rules=e2e_rules(), extproc_env=env, metrics_port=metrics)
    yield s, port, token
    s.stop()


def admin(port: int, token: Path, *argv: str) -> Any:
    out = subprocess.run(  # our own CLI
        [
            sys.executable,
            "-m",
            "extproc",
            "admin",
            *argv,
            "--address",
            f"127.0.0.1:{port}",
            "--token-file",
            str(token),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_created_key_works_on_both_replicas_and_is_refused_by_both_once_revoked(
    admin_stack: tuple[Stack, int, Path],
) -> None:
    """A key made with ``ai-quota admin create-key`` is admitted through Envoy by each of the
    two replicas (their own metrics say which served), and after ``revoke-key`` each refuses
    it (401); the file's own keys keep working."""
    stack, port, token = admin_stack
    admin(port, token, "set-tenant", "--tenant", "t-platform", "--plan", "big")
    made = admin(port, token, "create-key", "--tenant", "t-platform", "--name", "platform-1")
    sdk = client(stack, made["api_key"])

    def call() -> int:
        try:
            raw = sdk.chat.completions.with_raw_response.create(
                model="sim-small", messages=MSG, max_tokens=2
            )
        except openai.AuthenticationError:
            return 401
        assert raw.headers["x-ratelimit-limit-requests"] == "100000"  # plan big
        return raw.status_code

    # Until each replica has admitted the key once (Envoy spreads requests over both; one
    # that has not caught up yet answers 401 meanwhile).
    base = decisions(stack, "admitted", "ok")
    until(
        lambda: (
            call() == 200 and all(decisions(stack, "admitted", "ok")[i] > base[i] for i in (0, 1))
        )
    )
    assert [call() for _ in range(4)] == [200] * 4

    admin(port, token, "revoke-key", made["key_id"])
    base = decisions(stack, "error", "invalid_api_key")
    until(
        lambda: (
            call() == 401
            and all(decisions(stack, "error", "invalid_api_key")[i] > base[i] for i in (0, 1))
        )
    )
    assert [call() for _ in range(4)] == [401] * 4
    # the file's keys never stopped working
    client(stack, "sk-std").chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)


def decisions(stack: Stack, decision: str, code: str) -> list[float]:
    """``aiq_decisions_total{decision, code}`` of each replica, from its own metrics port."""
    out = []
    for i in range(2):
        url = f"http://127.0.0.1:{stack.metrics_port + i}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        value = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "aiq_decisions_total" and (
                    labels.get("decision"),
                    labels.get("code"),
                ) == (decision, code):
                    value = sample.value
        out.append(value)
    return out


def until(check: Callable[[], bool], within_s: float = 30.0) -> None:
    """Call ``check`` until it holds (the event), failing after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)


def test_levels_set_at_run_time_hold_and_are_named(admin_stack: tuple[Stack, int, Path]) -> None:
    """An organisation and a team made with ``ai-quota admin`` apply on both replicas: a key in
    the team is refused by the team's limit, another key of the tenant by the organisation's,
    each refusal naming its level; the organisation cannot be deleted while in use."""
    stack, port, token = admin_stack
    admin(port, token, "set-organisation", "--name", "o-run", "--limit", "{per: day, tpm: 300}")
    admin(
        port,
        token,
        "set-team",
        "--name",
        "tm-run",
        "--organisation",
        "o-run",
        "--limit",
        "{per: day, tpm: 150}",
    )
    admin(
        port, token, "set-tenant", "--tenant", "t-org", "--plan", "big", "--organisation", "o-run"
    )
    in_team = admin(
        port, token, "create-key", "--tenant", "t-org", "--name", "k1", "--team", "tm-run"
    )
    other = admin(port, token, "create-key", "--tenant", "t-org", "--name", "k2")
    view = admin(port, token, "get", "--tenant", "t-org")
    assert view["organisation"] == "o-run" and view["team"] == ""
    assert {k["name"]: k["team"] for k in view["keys"]} == {"k1": "tm-run", "k2": ""}
    levels = admin(port, token, "levels")["levels"]
    assert {(lv["kind"], lv["name"], lv["source"]) for lv in levels} >= {
        ("organisation", "o-run", "store"),
        ("team", "tm-run", "store"),
    }

    def refused_by(key: str) -> str:
        sdk = client(stack, key)
        for _ in range(40):
            try:
                sdk.chat.completions.create(model="sim-small", messages=MSG, max_tokens=40)
            except openai.AuthenticationError:
                time.sleep(0.05)  # a replica that has not caught up with the store yet
            except openai.RateLimitError as exc:
                return str(exc.response.headers.get("x-aiquota-limit-level", ""))
        raise AssertionError("never refused")

    assert refused_by(in_team["api_key"]) == "team=tm-run"
    assert refused_by(other["api_key"]) == "organisation=o-run"
    gone = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc",
            "admin",
            "delete-organisation",
            "--name",
            "o-run",
            "--address",
            f"127.0.0.1:{port}",
            "--token-file",
            str(token),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert gone.returncode == 1 and "FAILED_PRECONDITION" in gone.stderr, gone.stderr


def test_a_key_moved_to_another_team_counts_there_from_then_on(
    admin_stack: tuple[Stack, int, Path],
) -> None:
    """``ai-quota admin set-key-team``: a key refused by its team's limit is moved to another
    team of its organisation and goes on there; what it used stays in the old team's counter
    (the new team's starts from its requests after the move), the organisation's and the key's
    own counters hold both, each equal to what the simulator generated; a team of another
    organisation is refused; a rotation keeps the key's team."""
    import httpx
    import redis

    stack, port, token = admin_stack
    admin(port, token, "set-organisation", "--name", "o-mv", "--limit", "{per: day, tpm: 100000}")
    admin(port, token, "set-organisation", "--name", "o-other")
    for team, org, tpm in (("tm-a", "o-mv", 200), ("tm-b", "o-mv", 100000), ("tm-x", "o-other", 0)):
        limits = ["--limit", f"{{per: day, tpm: {tpm}}}"] if tpm else []
        admin(port, token, "set-team", "--name", team, "--organisation", org, *limits)
    admin(port, token, "set-tenant", "--tenant", "t-mv", "--plan", "big", "--organisation", "o-mv")
    key = admin(port, token, "create-key", "--tenant", "t-mv", "--name", "k", "--team", "tm-a")
    sdk = client(stack, key["api_key"])
    before: set[str] = set()
    after: set[str] = set()

    def send(ids: set[str]) -> str:
        """One request: "" when admitted (its id kept), else the refusing level."""
        rid = f"mv-{time.time_ns()}"
        try:
            sdk.chat.completions.create(
                model="sim-small", messages=MSG, max_tokens=40, extra_headers={"x-request-id": rid}
            )
        except openai.AuthenticationError:
            return "unknown key"  # a replica that has not caught up with the store yet
        except openai.RateLimitError as exc:
            return str(exc.response.headers.get("x-aiquota-limit-level", ""))
        ids.add(rid)
        return ""

    until(lambda: send(before) == "team=tm-a")
    rds = redis.Redis(port=stack.ports.redis, decode_responses=True)

    def used(scope: str) -> int:
        return sum(int(rds.get(k) or 0) for k in rds.scan_iter(f"aiq:{{@o.o-mv}}:tpm:{scope}:*"))

    def truth(ids: set[str]) -> int:
        recs = httpx.get(f"{stack.sim_url}/sim/requests").json()["requests"]
        mine = [r for r in recs if r["client_request_id"] in ids or r["request_id"] in ids]
        assert len(mine) == len(ids)
        return sum(r["prompt_tokens_reported"] + r["tokens_sent"] for r in mine)

    def settled() -> bool:
        states = [rds.hget(k, "state") for k in request_ledgers(rds, "aiq:{@o.o-mv}")]
        return all(s in ("settled", "reclaimed") for s in states)

    until(settled)
    team_a = used("g.tm-a")
    assert 200 - 100 < team_a <= 200 and team_a == truth(before)

    moved = admin(port, token, "set-key-team", key["key_id"], "--team", "tm-b")
    assert moved["version"] > key["version"]
    streak = [0]  # consecutive admissions: both replicas (Envoy alternates) run the move

    def goes_on() -> bool:
        streak[0] = streak[0] + 1 if send(after) == "" else 0
        return streak[0] >= 4

    until(goes_on)
    until(settled)
    assert used("g.tm-a") == team_a  # what it used stays in the old team's window
    assert used("g.tm-b") == truth(after) > 0  # the new team's: its requests since the move
    assert used("o") == used("t.t-mv") == team_a + used("g.tm-b")  # the tenant's go on
    view = admin(port, token, "get", "--tenant", "t-mv")
    assert {k["name"]: k["team"] for k in view["keys"]} == {"k": "tm-b"}
    rotated = admin(port, token, "rotate-key", key["key_id"])
    view = admin(port, token, "get", "--tenant", "t-mv")
    assert {k["key_id"]: k["team"] for k in view["keys"]} == {rotated["key_id"]: "tm-b"}
    refused = subprocess.run(
        [
            *(sys.executable, "-m", "extproc", "admin", "set-key-team", rotated["key_id"]),
            *("--team", "tm-x", "--address", f"127.0.0.1:{port}", "--token-file", str(token)),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
    assert "more than one organisation" in refused.stderr
    rds.close()
