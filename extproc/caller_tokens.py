"""The caller token file of the gateway's gRPC port (docs/security.md): one token per line
(blank lines and ``#`` comments ignored, so two tokens are valid at once during a rotation),
checked with one ``stat`` per call and read again when it changed.  Tokens are kept as digests
and compared in constant time; the logs show a token's fingerprint, never the token.
:class:`extproc.access.PortGuard` asks a :class:`TokenSet` whether a presented token is in
force."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import structlog

log = structlog.get_logger("extproc.access")


class AccessConfigError(ValueError):
    """The port's security settings cannot work; the message says what to set."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def fingerprint(token: str) -> str:
    """What the logs show of a token (never the token)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def parse_tokens(text: str) -> list[str]:
    """The tokens of a token file: one per line, blank lines and ``#`` comments ignored."""
    stripped = (line.strip() for line in text.splitlines())
    return [line for line in stripped if line and not line.startswith("#")]


class TokenSet:
    """The tokens in force, from a file read again whenever it changes (one ``stat`` per
    check).  A file that became unreadable or empty accepts no token until it is fixed: an
    operator who emptied it meant to stop the old ones."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        self._digests = self._load(strict=True)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows symlinks: a Secret volume swaps its ..data link
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self, *, strict: bool) -> tuple[bytes, ...]:
        try:
            tokens = parse_tokens(Path(self.path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            if strict:
                raise AccessConfigError(f"caller token file {self.path}: {exc}") from exc
            log.error("grpc_token_file_unusable", path=self.path, error=str(exc))
            return ()
        if not tokens:
            if strict:
                raise AccessConfigError(f"caller token file {self.path} holds no token")
            log.error("grpc_token_file_empty", path=self.path, note="refusing every token")
            return ()
        if not strict:
            log.info(
                "grpc_tokens_reloaded",
                path=self.path,
                principals=[fingerprint(t) for t in tokens],
            )
        return tuple(_digest(t) for t in tokens)

    def current(self) -> tuple[bytes, ...]:
        """The digests of the tokens in force now."""
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            self._digests = self._load(strict=False)
        return self._digests

    def matches(self, presented: str) -> bool:
        """Whether ``presented`` is one of the tokens in force (constant-time per token)."""
        if not presented:
            return False
        d = _digest(presented)
        ok = False
        for known in self.current():
            ok |= hmac.compare_digest(d, known)
        return ok
