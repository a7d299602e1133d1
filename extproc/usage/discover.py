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


def note(command: str, found: Found) -> None:
    """Say on stderr which address a command uses when it came from a stack.json."""
    if found.from_stack:
        print(f"{command}: using {found.value} (from {found.origin})", file=sys.stderr)
