"""The admin API on the real stack: a key created with ``ai-quota admin`` works through Envoy
with the openai SDK on both processor replicas, and is refused (401) within a second of its
revocation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from extproc.stack import Stack, free_port
from tests.e2e.conftest import client, make_stack
from tests.helpers import e2e_rules

pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "Say something."}]


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
    s = make_stack(workdir, extprocs=2, rules=e2e_rules(), extproc_env=env)
    yield s, port, token
    s.stop()


def admin(port: int, token: Path, *argv: str) -> Any:
    out = subprocess.run(  # noqa: S603 - our own CLI
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
        check=True,
    )
    return json.loads(out.stdout)


def test_a_created_key_works_and_is_refused_within_a_second_of_revocation(
    admin_stack: tuple[Stack, int, Path],
) -> None:
    """A key made with ``ai-quota admin create-key`` works through Envoy on both replicas and
    gets a 401 within a second of ``revoke-key``; the file's own keys keep working."""
    stack, port, token = admin_stack
    admin(port, token, "set-tenant", "--tenant", "t-platform", "--plan", "big")
    made = admin(port, token, "create-key", "--tenant", "t-platform", "--name", "platform-1")
    sdk = client(stack, made["api_key"])
    deadline = time.monotonic() + 1.0
    while True:  # every replica has it within a second (usually at once)
        try:
            sdk.chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "the new key was not accepted within 1 s"
            time.sleep(0.05)
    for _ in range(6):  # Envoy spreads these over both replicas
        raw = sdk.chat.completions.with_raw_response.create(
            model="sim-small", messages=MSG, max_tokens=2
        )
        assert raw.status_code == 200
        assert raw.headers["x-ratelimit-limit-requests"] == "100000"

    admin(port, token, "revoke-key", made["key_id"])
    revoked_at = time.monotonic()
    while True:
        try:
            sdk.chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)
        except openai.AuthenticationError:
            break
        assert time.monotonic() - revoked_at < 1.0, "a revoked key still worked after 1 s"
        time.sleep(0.02)
    assert time.monotonic() - revoked_at < 1.0
    for _ in range(6):
        with pytest.raises(openai.AuthenticationError):
            sdk.chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)
    # the file's keys never stopped working
    client(stack, "sk-std").chat.completions.create(model="sim-small", messages=MSG, max_tokens=2)
