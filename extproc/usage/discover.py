"""Finding the running stack's addresses for the side commands (``ai-quota usage`` and its
``export`` / ``consume``).

Each address is taken from, in order: the explicit flag; an ``AIQ_*`` variable; the
``stack.json`` that ``ai-quota up`` (``scripts/run``) wrote in its default workdir (``.run`` in
the current directory, else in the checkout this package runs from), when the process that wrote
it is still alive; the built-in default.  The commands say on stderr when an address came from a
``stack.json``, so their stdout stays clean.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from extproc.stack import DEFAULT_WORKDIR, STACK_FILE

DEFAULT_USAGE_ADDRESS = "127.0.0.1:50051"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class Found:
    """An address and where it came from: ``flag``, an ``AIQ_*`` name, a stack.json path or
    ``default``."""

    value: str
    origin: str

    @property
    def from_stack(self) -> bool:
        """Whether the address was read from a running stack's stack.json."""
        return self.origin.endswith(STACK_FILE)


def stack_files(cwd: Path | None = None) -> list[Path]:
    """Where ``ai-quota up`` writes stack.json by default: ``.run`` under the current directory,
    then under the checkout this package was installed from (``scripts/run`` starts it there)."""
    here = (cwd or Path.cwd()).resolve()
    out = [here / DEFAULT_WORKDIR / STACK_FILE]
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        theirs = checkout / DEFAULT_WORKDIR / STACK_FILE
        if theirs not in out:
            out.append(theirs)
    return out


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # no usable pid recorded: trust the file
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or no such pid can exist
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def running_stack(files: Sequence[Path]) -> tuple[dict[str, object], Path] | None:
    """The first readable stack.json among ``files`` whose writer is still running."""
    for path in files:
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and _alive(info.get("pid")):
            return info, path
    return None


def resolve(
    flag: str | None,
    env_names: Sequence[str],
    stack_key: str,
    default: str,
    *,
    env: Mapping[str, str] | None = None,
    files: Sequence[Path] | None = None,
) -> Found:
    """The address to use: ``flag`` > the first set variable of ``env_names`` > ``stack_key``
    of a running stack's stack.json > ``default``."""
    if flag:
        return Found(flag, "flag")
    environ = os.environ if env is None else env
    for name in env_names:
        if environ.get(name):
            return Found(environ[name], name)
    found = running_stack(stack_files() if files is None else files)
    if found is not None:
        info, path = found
        value = info.get(stack_key)
        if isinstance(value, str) and value:
            return Found(value, str(path))
    return Found(default, "default")


def usage_address(
    flag: str | None,
    *,
    env: Mapping[str, str] | None = None,
    files: Sequence[Path] | None = None,
) -> Found:
    """The usage API (gRPC) address: ``--address``, ``AIQ_USAGE_ADDRESS``, ``AIQ_GRPC_ADDRESS``,
    the stack's ``usage``, ``127.0.0.1:50051``."""
    names = ("AIQ_USAGE_ADDRESS", "AIQ_GRPC_ADDRESS")
    return resolve(flag, names, "usage", DEFAULT_USAGE_ADDRESS, env=env, files=files)


def redis_url(
    flag: str | None,
    *,
    env: Mapping[str, str] | None = None,
    files: Sequence[Path] | None = None,
) -> Found:
    """The Redis URL: ``--redis-url``, ``AIQ_REDIS_URL``, the stack's ``redis_url``, the
    default ``redis://127.0.0.1:6379/0``."""
    names = ("AIQ_REDIS_URL",)
    return resolve(flag, names, "redis_url", DEFAULT_REDIS_URL, env=env, files=files)


@dataclass(frozen=True)
class PortCredentials:
    """How a side command reaches the gRPC port: TLS with this CA (and server name) and a
    bearer token file (the admin token for any tenant); empty: plaintext, no token."""

    ca_file: str = ""
    server_name: str = ""
    token_file: str = ""
    cert_file: str = ""  # a client certificate, for a port that asks for one (mutual TLS)
    key_file: str = ""

    def channel(self, address: str) -> Any:
        """A blocking channel to ``address`` (TLS when a CA is known)."""
        if not self.ca_file:
            return grpc.insecure_channel(address)
        pair: tuple[bytes, bytes] | tuple[None, None] = (None, None)
        if self.cert_file:
            pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        creds = grpc.ssl_channel_credentials(Path(self.ca_file).read_bytes(), *pair)
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, creds, options=options)

    def token(self) -> str:
        """The first token of the token file ("" without one)."""
        if not self.token_file:
            return ""
        for line in Path(self.token_file).read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                return line.strip()
        return ""


def port_credentials(
    found: Found,
    *,
    ca_file: str | None = None,
    token_file: str | None = None,
    server_name: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    env: Mapping[str, str] | None = None,
    files: Sequence[Path] | None = None,
) -> PortCredentials:
    """The flags; else ``AIQ_USAGE_CA_FILE`` / ``AIQ_USAGE_TOKEN_FILE`` /
    ``AIQ_USAGE_SERVER_NAME``; else, when the address is a running stack's (read from its
    stack.json, or given and listed there), that stack's CA and admin token
    (docs/security.md)."""
    environ = os.environ if env is None else env
    ca = ca_file or environ.get("AIQ_USAGE_CA_FILE", "")
    token = token_file or environ.get("AIQ_USAGE_TOKEN_FILE", "")
    name = server_name or environ.get("AIQ_USAGE_SERVER_NAME", "")
    info: object = {}
    if found.from_stack and not (ca or token):
        try:
            info = json.loads(Path(found.origin).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {}
    elif not (ca or token):  # an address given by hand: the running stack's, if it is one
        running = running_stack(stack_files() if files is None else files)
        if running is not None:
            listed = running[0].get("extprocs")
            if isinstance(listed, list) and found.value in listed:
                info = running[0]
    if info:
        creds = info.get("credentials") if isinstance(info, dict) else None
        if isinstance(creds, dict):
            ca = str(creds.get("ca") or "")
            token = str(creds.get("admin_token_file") or "")
            name = name or str(creds.get("server_name") or "")
            mtls = isinstance(info, dict) and info.get("security") == "mtls"
            if mtls and not cert_file:
                cert_file = str(creds.get("client_cert") or "")
                key_file = str(creds.get("client_key") or "")
    return PortCredentials(
        ca_file=ca,
        server_name=name,
        token_file=token,
        cert_file=cert_file or "",
        key_file=key_file or "",
    )


def note(command: str, found: Found) -> None:
    """Say on stderr which address a command uses when it came from a stack.json."""
    if found.from_stack:
        print(f"{command}: using {found.value} (from {found.origin})", file=sys.stderr)
