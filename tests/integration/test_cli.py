"""The `ai-quota` command line: help for every subcommand, check-config exit codes and messages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "sub", ["serve", "up", "sim", "load", "check-config", "usage", "envoy-config"]
)
def test_every_subcommand_has_help(sub: str) -> None:
    """`ai-quota SUB --help` exits 0 and describes its options."""
    p = run(sub, "--help")
    assert p.returncode == 0, p.stderr
    assert "usage: ai-quota" in p.stdout and "--" in p.stdout


def test_check_config_accepts_the_demo_rules() -> None:
    """The shipped demo rules are valid."""
    p = run("check-config", "config/demo.yaml")
    assert p.returncode == 0
    assert "OK" in p.stdout and "4 tenants" in p.stdout


def test_check_config_names_file_and_path_of_each_error(tmp_path: Path) -> None:
    """An invalid file exits 1 and every error names the file and the dotted path."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (ROOT / "config/demo.yaml")
        .read_text()
        .replace("max_output_tokens: 1024", "max_output_tokens: 1024\n    colour: blue")
        .replace("rpm: 5,", "rpm: -5,")
    )
    p = run("check-config", str(bad))
    assert p.returncode == 1
    where = re.escape(str(bad))
    assert re.search(rf"^{where}:\d+:\d+: models.sim-small.colour: unknown key$", p.stderr, re.M)
    assert re.search(rf"^{where}:\d+:\d+: plans.tight.limits\[0\].rpm: ", p.stderr, re.M)


def test_check_config_reports_a_missing_file(tmp_path: Path) -> None:
    """A path that does not exist is a clear error, not a traceback."""
    p = run("check-config", str(tmp_path / "nope.yaml"))
    assert p.returncode == 1
    assert "cannot read config" in p.stderr and "Traceback" not in p.stderr


def test_envoy_config_matches_the_committed_default() -> None:
    """`ai-quota envoy-config` with defaults reproduces envoy/envoy.yaml byte for byte (no
    drift), its first lines included: without credentials they say the bootstrap needs
    processors started --insecure."""
    from extproc.envoy_config import PLAINTEXT_WARNING

    p = run("envoy-config")
    assert p.returncode == 0
    committed = (ROOT / "envoy/envoy.yaml").read_text()
    assert committed == p.stdout
    assert committed.split("\n")[1:3] == PLAINTEXT_WARNING.split("\n")[:2]
    assert "serve --insecure" in committed.split("admin:", 1)[0]


def test_up_refuses_a_busy_port() -> None:
    """`ai-quota up` names the port that is already in use and exits 1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        p = run("up", "--port", str(busy), "--workdir", "/tmp/aiq-busy-test")
    assert p.returncode == 1
    assert f"envoy port {busy}" in p.stderr and "already in use" in p.stderr
