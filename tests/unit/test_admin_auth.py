"""The admin API's credentials: the bearer token (and its file, followed as it changes), the
listener checks, and the principal the audit log records."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from extproc.admin.auth import (
    ACTOR_METADATA,
    BearerAuth,
    TokenFile,
    caller,
    check_listen,
    fingerprint,
    is_loopback,
)
from extproc.admin.errors import AdminConfigError

pytestmark = pytest.mark.unit


def token_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_bearer_auth_compares_the_token() -> None:
    """Only the exact bearer token passes; the scheme is case-insensitive."""
    auth = BearerAuth(TokenFile.fixed("s3cret"))
    assert auth.allows([("authorization", "Bearer s3cret")])
    assert auth.allows([("authorization", "bearer s3cret")])
    assert not auth.allows([("authorization", "Bearer wrong")])
    assert not auth.allows([("authorization", "Bearer ")])
    assert not auth.allows([("authorization", "s3cret")])
    assert not auth.allows([])


def test_the_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    """Rotating the token needs no restart: the next call sees the new file; the old token
    stops at once."""
    path = token_file(tmp_path, "first-token\n")
    tokens = TokenFile(str(path))
    assert tokens.matches("first-token")
    new = tmp_path / "token.new"
    new.write_text("second-token")
    os.replace(new, path)  # how a Secret volume or an atomic deploy swaps it
    assert tokens.matches("second-token")
    assert not tokens.matches("first-token")


def test_a_token_file_made_empty_or_removed_refuses_every_call(tmp_path: Path) -> None:
    """Fail closed: an operator who blanked the file meant to stop the old token."""
    path = token_file(tmp_path, "tok")
    tokens = TokenFile(str(path))
    path.write_text("   \n")
    assert tokens.current() is None
    assert not tokens.matches("tok") and not tokens.matches("")
    path.unlink()
    assert not tokens.matches("tok")
    path.write_text("back")
    assert tokens.matches("back")


def test_a_bad_token_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(AdminConfigError, match="is empty"):
        TokenFile(str(token_file(tmp_path, "\n")))
    with pytest.raises(AdminConfigError, match="admin token file"):
        TokenFile(str(tmp_path / "missing"))


def test_listener_checks() -> None:
    """Off loopback the admin API needs credentials (a token or client certificates) and TLS
    (or an explicit plaintext opt-in); client certificates need TLS."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    check_listen("127.0.0.1", token=False, tls=False)  # allowed, with a warning
    with pytest.raises(AdminConfigError, match="needs credentials"):
        check_listen("0.0.0.0", token=False, tls=True)
    with pytest.raises(AdminConfigError, match="plaintext"):
        check_listen("0.0.0.0", token=True, tls=False)
    with pytest.raises(AdminConfigError, match="mutual TLS"):
        check_listen("127.0.0.1", token=False, tls=False, client_certs=True)
    check_listen("0.0.0.0", token=True, tls=True)
    check_listen("0.0.0.0", token=False, tls=True, client_certs=True)
    check_listen("0.0.0.0", token=True, tls=False, allow_plaintext=True)


class Ctx:
    """The parts of a gRPC servicer context ``caller`` reads."""

    def __init__(self, metadata: list[tuple[str, str]], auth: dict[str, Any]) -> None:
        self.metadata, self.auth = metadata, auth

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def auth_context(self) -> dict[str, Any]:
        return self.auth

    def peer(self) -> str:
        return "ipv4:10.1.2.3:5555"


def test_the_principal_names_the_credential_never_the_token() -> None:
    tokens = TokenFile.fixed("s3cret")
    who = caller(Ctx([("authorization", "Bearer s3cret"), (ACTOR_METADATA, "alice")], {}), tokens)
    assert who.principal == fingerprint("s3cret") and "s3cret" not in who.principal
    assert who.on_behalf_of == "alice" and who.peer == "ipv4:10.1.2.3:5555"
    both = caller(
        Ctx([("authorization", "Bearer s3cret")], {"x509_common_name": [b"ops-bot"]}), tokens
    )
    assert both.principal == f"cert:ops-bot+{fingerprint('s3cret')}"
    assert caller(Ctx([], {}), None).principal == "loopback"
