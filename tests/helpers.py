"""Shared test helpers: a real redis-server, the e2e rules file, counter reads."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import redis
import yaml

from extproc.stack import free_port


def spawn(
    argv: list[str], log: Path, *, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log`` (the child keeps its own
    descriptor; the test's is closed at once, never leaked)."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


class RedisServer:
    """A real redis-server on a free loopback port, in its own directory."""

    def __init__(self, workdir: Path, *, extra: list[str] | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = spawn(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                *(extra or []),
            ],
            workdir / "redis.log",
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A synchronous client."""
        return redis.Redis(port=self.port, decode_responses=True)

    def stop(self) -> None:
        """Terminate the server."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> float:
        """Start the stopped server again on its port, with its arguments (an AOF it wrote is
        loaded); seconds until it answered PING."""
        started = time.monotonic()
        self.proc = spawn(list(self.proc.args), self.workdir / "redis.log")  # type: ignore[arg-type]
        client = redis.Redis(port=self.port)
        try:
            while True:
                try:
                    client.ping()
                    return time.monotonic() - started
                except redis.exceptions.RedisError:
                    if time.monotonic() - started > 10:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()


def e2e_rules(extra_tenants: dict[str, dict[str, Any]] | None = None, **top: Any) -> dict[str, Any]:
    """The rules the end-to-end suite runs on: one tenant per scenario, daily windows (a test
    that straddles a boundary loses the old window's counters two seconds after it ends: with
    hourly windows a CI run starting near the top of an hour hit it), plaintext test keys."""

    def tenant(plan: str, key: str, limits: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        t: dict[str, Any] = {"plan": plan, "keys": [{"name": key, "plaintext": f"sk-{key}"}]}
        if limits:
            t["limits"] = limits
        return t

    hour = "day"  # a day: a test run crosses a window boundary far more rarely than an hour
    rules: dict[str, Any] = {
        "version": 1,
        "charging": {"mode": "stream_incremental", "streaming": "lazy", "charge_every_tokens": 16},
        "models": {
            "sim-small": {
                "aliases": ["sim"],
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 1024,
            }
        },
        "plans": {
            "big": {"limits": [{"model": "*", "per": hour, "rpm": 100000, "tpm": 10_000_000}]},
            "rpm2": {"limits": [{"model": "*", "per": hour, "rpm": 2, "tpm": 10_000_000}]},
            "rpm4": {"limits": [{"model": "*", "per": hour, "rpm": 4, "tpm": 10_000_000}]},
            "tpm300": {"limits": [{"model": "*", "per": hour, "rpm": 1000, "tpm": 300}]},
            "tpm300strict": {
                "limits": [{"model": "*", "per": hour, "rpm": 1000, "tpm": 300}],
                "charging": {"streaming": "strict"},
            },
            "tpm2000": {"limits": [{"model": "*", "per": hour, "rpm": 1000, "tpm": 2000}]},
            "tpm2000strict": {
                "limits": [{"model": "*", "per": hour, "rpm": 1000, "tpm": 2000}],
                "charging": {"streaming": "strict"},
            },
            "tpm5000": {"limits": [{"model": "*", "per": hour, "rpm": 1000, "tpm": 5000}]},
            "tpm4000strict": {
                "limits": [{"model": "*", "per": hour, "rpm": 1000, "tpm": 4000}],
                "charging": {"streaming": "strict"},
            },
            "inputonly": {
                "limits": [{"model": "*", "per": hour, "tpm": 100000}],
                "charging": {"mode": "input_only"},
            },
            "reservemax": {
                "limits": [{"model": "*", "per": hour, "tpm": 100000}],
                "charging": {"mode": "reserve_max"},
            },
            "reserverefund": {
                "limits": [{"model": "*", "per": hour, "tpm": 100000}],
                "charging": {"mode": "reserve_refund"},
            },
            "bigopen": {
                "limits": [{"model": "*", "per": hour, "rpm": 100000, "tpm": 10_000_000}],
                "failure_mode": "open",
            },
            "modeltpm": {
                "limits": [
                    {"model": "*", "per": hour, "tpm": 100000},
                    {"model": "sim-small", "per": hour, "tpm": 500},
                    {"model": "*", "scope": "key", "per": hour, "rpm": 3},
                ]
            },
        },
        "tenants": {},
    }
    names = {
        "std": "big",
        "auth": "big",
        "bad": "big",
        "nonstream": "big",
        "passthru": "big",
        "rpm": "rpm2",
        "twoenvoy": "rpm4",
        "tpm": "tpm300",
        "cut": "tpm300",
        "strict": "tpm300strict",
        "disc": "big",
        "reset": "big",
        "refund": "tpm5000",
        "uperr": "tpm5000",
        "meta": "tpm300",
        "conclazy": "tpm2000",
        "concstrict": "tpm2000strict",
        "usage": "tpm5000",
        "drain": "big",
        "alias": "big",
        "toolong": "tpm300",
        "inputonly": "inputonly",
        "reservemax": "reservemax",
        "reserverefund": "reserverefund",
        "closed": "big",
        "open": "bigopen",
        "closedstream": "big",
        "openstream": "bigopen",
        "estimate": "big",
        "modeltpm": "modeltpm",
        "loadsmoke": "tpm300",
        "completions": "big",
        "reload": "big",
        "replay": "big",
        "bound": "big",
        "boundstrict": "tpm4000strict",
    }
    for name, plan in names.items():
        rules["tenants"][f"t-{name}"] = tenant(plan, name)
    for name, t in (extra_tenants or {}).items():
        rules["tenants"][name] = t
    rules.update(top)
    return rules


def write_rules(path: Path, rules: dict[str, Any]) -> Path:
    """Write a rules dict as YAML."""
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def tpm_used(client: redis.Redis, tenant: str, metric: str = "tpm") -> int:
    """Sum of the tenant-wide counters of ``metric`` in their current windows."""
    total = 0
    for key in client.scan_iter(f"aiq:{{{tenant}}}:{metric}:t:*"):
        total += int(client.get(key) or 0)
    return total


#: Ledgers the allowance wrapper keeps in a tenant's slot beside its requests' (semantics.md,
#: "Local allowances"): a replica's allowance ledger (open while it holds never-opened
#: tranches), its usage-record draft ledger, and each give-back's ledger.  Not requests.
ALLOWANCE_LEDGERS = (":req:allow.", ":req:drafts.", ":req:allowance.")


def request_ledgers(rds: redis.Redis, tag: str) -> list[Any]:
    """The ledger keys of the requests in the slot of ``tag`` (``aiq:{t}``): every
    ``<tag>:req:*`` key but the allowance wrapper's own ledgers."""
    out = []
    for k in rds.scan_iter(f"{tag}:req:*"):
        name = k.decode() if isinstance(k, bytes) else str(k)
        if not any(m in name for m in ALLOWANCE_LEDGERS):
            out.append(k)
    return out


def settled(rds: redis.Redis, tenant: str, *, expect: int = 1) -> int:
    """The tenant's TPM once every request of it that settles has been settled.

    Waits on the settlements themselves: each request's ledger says ``state: settled`` once
    its settlement script ran (modes that never settle, input_only and reserve_max, are
    final at admission and need no waiting)."""
    deadline = time.monotonic() + 15
    while True:
        states = [rds.hget(k, "state") for k in request_ledgers(rds, f"aiq:{{{tenant}}}")]
        done = sum(1 for s in states if s in (b"settled", "settled", b"reclaimed", "reclaimed"))
        if done >= expect and done == len(states):
            return tpm_used(rds, tenant)
        if time.monotonic() > deadline:
            raise AssertionError(f"{tenant}: settlements not applied: {states}")
        time.sleep(0.02)


def far_ms() -> int:
    """An expiry two minutes from now (unix ms): counters written by limiter tests outlive them."""
    return int(time.time() * 1000) + 120_000
