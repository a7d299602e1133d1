"""Unit tests for how ``ai-quota usage`` (and ``usage export``) find the running stack."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from extproc.cli import build_parser
from extproc.stack import DEFAULT_WORKDIR, STACK_FILE
from extproc.usage import discover, records_cli
from extproc.usage.discover import redis_url, stack_files, usage_address

pytestmark = pytest.mark.unit

NO_PID = 2**31 - 1  # larger than any pid the kernel hands out


def write_stack(path: Path, *, usage: str, redis: str, pid: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"usage": usage, "extproc": usage, "redis_url": redis, "pid": pid or os.getpid()}
    path.write_text(json.dumps(info))
    return path


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    """A stack.json a running stack (this process) wrote, with non-default addresses."""
    return write_stack(
        tmp_path / DEFAULT_WORKDIR / STACK_FILE,
        usage="127.0.0.1:50061",
        redis="redis://127.0.0.1:6390/0",
    )


def test_flag_wins_over_everything(stack: Path) -> None:
    env = {"AIQ_USAGE_ADDRESS": "10.0.0.1:1"}
    found = usage_address("127.0.0.1:7", env=env, files=[stack])
    assert (found.value, found.origin) == ("127.0.0.1:7", "flag")


def test_environment_wins_over_stack_json(stack: Path) -> None:
    found = usage_address(None, env={"AIQ_USAGE_ADDRESS": "10.0.0.1:1"}, files=[stack])
    assert (found.value, found.origin) == ("10.0.0.1:1", "AIQ_USAGE_ADDRESS")
    found = usage_address(None, env={"AIQ_GRPC_ADDRESS": "10.0.0.2:2"}, files=[stack])
    assert (found.value, found.origin) == ("10.0.0.2:2", "AIQ_GRPC_ADDRESS")
    found = redis_url(None, env={"AIQ_REDIS_URL": "redis://h:1/0"}, files=[stack])
    assert (found.value, found.origin) == ("redis://h:1/0", "AIQ_REDIS_URL")


def test_stack_json_wins_over_the_default(stack: Path) -> None:
    found = usage_address(None, env={}, files=[stack])
    assert (found.value, found.origin) == ("127.0.0.1:50061", str(stack))
    assert found.from_stack
    found = redis_url(None, env={}, files=[stack])
    assert (found.value, found.origin) == ("redis://127.0.0.1:6390/0", str(stack))


def test_default_without_a_stack(tmp_path: Path) -> None:
    missing = tmp_path / DEFAULT_WORKDIR / STACK_FILE
    found = usage_address(None, env={}, files=[missing])
    assert (found.value, found.origin) == ("127.0.0.1:50051", "default")
    assert redis_url(None, env={}, files=[missing]).value == "redis://127.0.0.1:6379/0"


def test_a_stale_or_broken_stack_json_is_ignored(tmp_path: Path, stack: Path) -> None:
    """A stack.json whose writer is gone (killed -9) or that is not JSON is skipped."""
    stale = write_stack(tmp_path / "a" / STACK_FILE, usage="x:1", redis="r", pid=NO_PID)
    broken = tmp_path / "b" / STACK_FILE
    broken.parent.mkdir()
    broken.write_text("{not json")
    assert usage_address(None, env={}, files=[stale, broken]).origin == "default"
    assert usage_address(None, env={}, files=[stale, broken, stack]).value == "127.0.0.1:50061"


def test_the_default_workdir_is_the_one_up_uses(tmp_path: Path) -> None:
    """``ai-quota up`` writes ``<cwd>/.run/stack.json`` by default: discovery looks there first."""
    args = build_parser().parse_args(["up"])
    assert args.workdir == DEFAULT_WORKDIR
    assert stack_files(tmp_path)[0] == tmp_path.resolve() / DEFAULT_WORKDIR / STACK_FILE


def test_usage_and_export_use_the_stack_and_say_so_on_stderr(
    stack: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both commands find the stack's addresses; the note goes to stderr, stdout stays clean."""
    monkeypatch.setattr(discover, "stack_files", lambda cwd=None: [stack])
    for name in ("AIQ_USAGE_ADDRESS", "AIQ_GRPC_ADDRESS", "AIQ_REDIS_URL", "AIQ_USAGE_STREAM"):
        monkeypatch.delenv(name, raising=False)
    url, stream = records_cli.target(argparse.Namespace(redis_url=None, stream=None))
    assert (url, stream) == ("redis://127.0.0.1:6390/0", "aiq:usage")
    out = capsys.readouterr()
    assert out.out == ""
    assert f"using redis://127.0.0.1:6390/0 (from {stack})" in out.err

    assert usage_address(None).value == "127.0.0.1:50061"
    args = build_parser().parse_args(["usage", "--key", "k"])
    assert args.address is None  # resolved at run time, not baked into the flag's default


def test_no_note_when_the_address_was_given(capsys: pytest.CaptureFixture[str]) -> None:
    discover.note("ai-quota usage", usage_address("127.0.0.1:1"))
    assert capsys.readouterr().err == ""


def _closed_stack(path: Path, security: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    creds = {
        "ca": "/c/ca.pem",
        "admin_token_file": "/c/admin-token",
        "client_cert": "/c/envoy.pem",
        "client_key": "/c/envoy.key",
        "server_name": "ai-quota",
    }
    info = {
        "usage": "127.0.0.1:50061",
        "extprocs": ["127.0.0.1:50061"],
        "pid": os.getpid(),
        "security": security,
        "credentials": creds,
    }
    path.write_text(json.dumps(info))
    return path


def test_the_stacks_credentials_come_with_its_address(tmp_path: Path) -> None:
    """An address from (or listed in) a running stack's stack.json brings its CA and admin
    token, and in mutual TLS Envoy's client certificate; flags and other addresses do not."""
    path = _closed_stack(tmp_path / DEFAULT_WORKDIR / STACK_FILE, "token")
    found = usage_address(None, env={}, files=[path])
    door = discover.port_credentials(found, env={}, files=[path])
    assert (door.ca_file, door.token_file, door.server_name) == (
        "/c/ca.pem",
        "/c/admin-token",
        "ai-quota",
    )
    assert door.cert_file == ""
    given = discover.port_credentials(
        discover.Found("127.0.0.1:50061", "flag"), env={}, files=[path]
    )
    assert given == door  # the stack's own address, given by hand
    other = discover.port_credentials(discover.Found("10.0.0.1:1", "flag"), env={}, files=[path])
    assert other == discover.PortCredentials()  # plaintext, nothing sent
    mine = discover.port_credentials(found, ca_file="/mine.pem", env={}, files=[path])
    assert mine.ca_file == "/mine.pem" and mine.token_file == ""
    mtls = _closed_stack(tmp_path / "m" / DEFAULT_WORKDIR / STACK_FILE, "mtls")
    door = discover.port_credentials(
        usage_address(None, env={}, files=[mtls]), env={}, files=[mtls]
    )
    assert (door.cert_file, door.key_file) == ("/c/envoy.pem", "/c/envoy.key")
