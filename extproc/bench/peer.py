"""The peer the bench's ``peer`` section compares the gateway with: the LiteLLM proxy.

LiteLLM is pinned (:data:`PIN`) and installed by the bench into a virtualenv of its own
(:data:`VENV`, ``.venv-peer/`` at the repository root, ignored by git): made on first use with
``pip install``, reused after (a stamp file records the pin it holds), so no network is needed
once it exists.  The project's own dependencies never include LiteLLM.

How it is configured (:func:`render_config`, :data:`AUTH_MODULE`), honestly:

* ``model_list``: ``sim-small`` (and ``sim-small-itl<N>`` for N in :data:`ITLS`, the same model
  with the simulator's ``x-sim-itl-ms: N`` header added through ``extra_headers``, because
  LiteLLM does not forward a client's ``x-sim-*`` headers) as ``openai/sim-small`` at the simulator the gateway's Envoy
  routes to;
* its limits: LiteLLM's per-key TPM/RPM limits, enforced by its default limiter (the v3
  "parallel request limiter", Lua scripts on Redis) on the **same redis-server** the gateway
  uses (``general_settings.coordination_redis``).  Per-key limits normally live with virtual
  keys in LiteLLM's Postgres database, which the bench does not run; instead a
  ``custom_auth`` hook (LiteLLM's documented extension point) answers every bearer token
  with its limits: keys starting ``sk-peer-limited-`` get :data:`LIMITED_TPM` TPM, every other
  key a limit so large it never binds (the limiter still runs and writes Redis on every
  request).  Each enforcement run uses a fresh limited key, so it starts a fresh LiteLLM
  window (its windows start at a key's first request, 60 s long);
* a master key (LiteLLM refuses to start without one), no database, no response cache, no
  callbacks, one uvicorn worker; ``LITELLM_TPM_TOKEN_RESERVATION_ENABLED`` is LiteLLM's own
  switch for reserving a request's estimated tokens at admission (on by default).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.bench.system import PEER_RPM, PEER_TPM

#: The LiteLLM release the bench measures: the newest 1.x whose ``[proxy]`` extra installs from
#: the package index this project uses (1.108.8 to 1.110.2 pin ``litellm-enterprise``,
#: ``litellm-proxy-extras`` or ``litellm-proxy`` releases that index does not have).
LITELLM_VERSION = "1.108.7"
PIN = f"litellm[proxy]=={LITELLM_VERSION}"
#: The peer's virtualenv, at the repository root.
VENV = Path(__file__).resolve().parents[2] / ".venv-peer"
#: Written into the venv once ``pip install PIN`` succeeded; holds the pin.
STAMP = ".aiq-peer-installed"
#: How long the first install may take (a few hundred MB of wheels).
INSTALL_TIMEOUT_S = 1200.0

#: Keys with this prefix are limited to LIMITED_TPM tokens per minute (and LIMITED_RPM).
LIMITED_PREFIX = "sk-peer-limited-"
#: (the gateway's ``peer-*`` tenants have the same limits, per minute).
LIMITED_TPM = PEER_TPM
#: High enough never to bind in the enforcement runs: TPM is the limit measured.
LIMITED_RPM = PEER_RPM
#: The other keys' limits: checked and counted in Redis on every request, never reached.
UNLIMITED_TPM = 10**12
UNLIMITED_RPM = 10**12

#: The simulator's inter-token delays (ms) LiteLLM serves a model name for (streams).
ITLS = (1, 10)


def itl_model(itl_ms: float) -> str:
    """The name LiteLLM serves the simulator's model under with ``itl_ms`` between tokens."""
    if itl_ms not in ITLS:
        raise ValueError(f"no LiteLLM model with {itl_ms} ms between tokens (have {ITLS})")
    return f"sim-small-itl{itl_ms:g}"


#: The ``custom_auth`` module written next to the config (see the module docstring).
AUTH_MODULE = f'''"""Written by ai-quota's bench (extproc/bench/peer.py): every bearer token is a key;
{LIMITED_PREFIX}* keys get {LIMITED_TPM} TPM, the others limits that never bind."""

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    if api_key.startswith("{LIMITED_PREFIX}"):
        return UserAPIKeyAuth(api_key=api_key, tpm_limit={LIMITED_TPM}, rpm_limit={LIMITED_RPM})
    return UserAPIKeyAuth(api_key=api_key, tpm_limit={UNLIMITED_TPM}, rpm_limit={UNLIMITED_RPM})
'''


class PeerUnavailable(RuntimeError):
    """The peer cannot be installed or started here (the section is skipped, not failed)."""


def litellm_bin(venv: Path = VENV) -> Path:
    """The ``litellm`` command of the venv."""
    return venv / "bin" / "litellm"


def installed(venv: Path = VENV) -> bool:
    """The venv holds :data:`PIN` (its stamp says so and the command exists)."""
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text().strip() == PIN and litellm_bin(venv).exists()


def ensure_venv(venv: Path = VENV, python: str = sys.executable) -> Path:
    """Make the venv with :data:`PIN` unless it already holds it; return the ``litellm``
    command.  Raises :class:`PeerUnavailable` with the reason when it cannot be made (no
    network on first use, a wheel missing from the index ...); a half-made venv is removed."""
    if installed(venv):
        return litellm_bin(venv)
    fresh = not venv.exists()
    try:
        if fresh:
            _run([python, "-m", "venv", str(venv)], 300.0)
        _run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PIN],
            INSTALL_TIMEOUT_S,
        )
    except PeerUnavailable:
        if fresh:
            shutil.rmtree(venv, ignore_errors=True)
        raise
    (venv / STAMP).write_text(PIN + "\n")
    if not litellm_bin(venv).exists():
        raise PeerUnavailable(f"{PIN} installed but {litellm_bin(venv)} is missing")
    return litellm_bin(venv)


def _run(argv: Sequence[str], timeout_s: float) -> None:
    try:
        done = subprocess.run(  # noqa: S603 - our own argv
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerUnavailable(f"{' '.join(argv[:4])}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join(
            line
            for line in (done.stdout + done.stderr).splitlines()
            if not line.startswith("WARNING: Location")  # pip's note per unused local index
        )[-600:]
        raise PeerUnavailable(f"{' '.join(argv[:4])} ... exited {done.returncode}: {tail}")


def render_config(sim_port: int, redis_port: int, master_key: str) -> dict[str, Any]:
    """LiteLLM's proxy config: the simulator's model (plain and with 1 ms between tokens), the
    custom auth hook, the gateway's Redis for its limiter.  See the module docstring."""
    base = {
        "model": "openai/sim-small",
        "api_base": f"http://127.0.0.1:{sim_port}/v1",
        "api_key": "sk-sim",  # the simulator checks none; the openai client wants one
    }
    return {
        "model_list": [
            {"model_name": "sim-small", "litellm_params": dict(base)},
            *(
                {
                    "model_name": itl_model(ms),
                    "litellm_params": {**base, "extra_headers": {"x-sim-itl-ms": f"{ms:g}"}},
                }
                for ms in ITLS
            ),
        ],
        "general_settings": {
            "master_key": master_key,
            "custom_auth": "peer_auth.user_api_key_auth",
            "coordination_redis": {"host": "127.0.0.1", "port": redis_port},
        },
    }


def peer_env(reservation: bool) -> dict[str, str]:
    """LiteLLM's environment: the packaged model cost map (no fetch at start-up), errors-only
    logs, and its TPM reservation switch."""
    return {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TPM_TOKEN_RESERVATION_ENABLED": "true" if reservation else "false",
    }


@dataclass
class Peer:
    """A running LiteLLM proxy."""

    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path
    reservation: bool

    @property
    def base_url(self) -> str:
        """Its OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int:
        """Its process id (the root of the tree whose CPU is measured)."""
        return self.popen.pid

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start(
    command: Path,
    workdir: Path,
    *,
    sim_port: int,
    redis_port: int,
    port: int,
    reservation: bool = True,
    ready_timeout_s: float = 180.0,
) -> Peer:
    """Write the config and auth hook under ``workdir`` and start the proxy on ``port``; wait
    until it answers its liveness probe.  Raises :class:`PeerUnavailable` if it exits or does
    not answer in time (its log's tail in the message)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "peer_auth.py").write_text(AUTH_MODULE)
    cfg = workdir / "litellm.yaml"
    cfg.write_text(
        yaml.safe_dump(
            render_config(sim_port, redis_port, "sk-" + secrets.token_hex(24)), sort_keys=False
        )
    )
    log_path = workdir / "litellm.log"
    env = {**os.environ, **peer_env(reservation), "PYTHONPATH": str(workdir)}
    with log_path.open("wb") as log:
        popen = subprocess.Popen(  # noqa: S603 - our own argv
            [
                *(str(command), "--config", str(cfg), "--host", "127.0.0.1"),
                *("--port", str(port), "--num_workers", "1"),
            ],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    peer = Peer(popen, port, log_path, reservation)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            break
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health/liveliness", timeout=2
            ) as r:
                if r.status == 200:
                    return peer
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    peer.stop()
    tail = log_path.read_text(errors="replace")[-800:]
    raise PeerUnavailable(f"LiteLLM did not start on :{port} (exit {popen.poll()}): {tail}")


def served_tokens(records: Iterable[Mapping[str, Any]]) -> int:
    """Tokens the upstream served: each request's prompt and the output tokens it really
    wrote, over the records given (the simulator's ``GET /sim/requests`` entries, read raw:
    requests through LiteLLM carry no ``x-client-request-id``, which
    :func:`extproc.bench.system.sim_records` keeps only)."""
    return sum(int(r.get("prompt_tokens", 0)) + int(r.get("tokens_sent", 0)) for r in records)


def enforcement(served: int, limit: int, delivered: int | None = None) -> dict[str, float]:
    """``served`` (what the upstream spent) against ``limit``: the share of the limit used (%)
    and the tokens over it; with ``delivered`` (prompts plus the output tokens that reached
    the clients: less than served when a proxy cuts streams, by the tokens in flight at the
    cut), the tokens over the limit that reached clients too."""
    out = {
        "served": float(served),
        "limit": float(limit),
        "used_pct": 100.0 * served / limit,
        "over": float(max(0, served - limit)),
    }
    if delivered is not None:
        out["delivered"] = float(delivered)
        out["over_delivered"] = float(max(0, delivered - limit))
    return out
