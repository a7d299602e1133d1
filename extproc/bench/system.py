"""What the benchmarks read from the processes they run: CPU time from ``/proc``, Redis
``INFO commandstats``, Envoy admin counters; and how they start a stack on free ports."""

from __future__ import annotations

import os
import random
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from extproc.load.records import sim_record_from_json
from extproc.sim.records import SimRecord
from extproc.stack import Stack, StackPorts, free_port, port_in_use

_TICK = os.sysconf("SC_CLK_TCK")

# Commands a client sends as one round trip each.  Redis 7 also counts the commands a script
# runs (GET, INCRBY ... inside EVALSHA) in commandstats; those are not round trips.
LIMITER_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro", "mget")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        out += [int(x) for x in text.split()]
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (``serve --workers N`` runs N child processes)."""
    seen: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of each process (all its threads), summed, in seconds."""
    total = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / _TICK


class CpuMeter:
    """CPU seconds used by a process tree between ``start()`` and ``stop()``."""

    def __init__(self, root_pids: Sequence[int]) -> None:
        self.roots = list(root_pids)
        self._pids: list[int] = []
        self._t0 = 0.0

    def start(self) -> None:
        """Take the starting reading (the tree is re-read so late workers are included)."""
        self._pids = [p for r in self.roots for p in tree(r)]
        self._t0 = cpu_seconds(self._pids)

    def stop(self) -> float:
        """CPU seconds since ``start()``."""
        return cpu_seconds(self._pids) - self._t0


def redis_calls(url_port: int) -> dict[str, int]:
    """Calls per command from ``INFO commandstats`` (command name → calls)."""
    client = redis.Redis(port=url_port)
    try:
        info: dict[str, Any] = client.info("commandstats")
    finally:
        client.close()
    out: dict[str, int] = {}
    for k, v in info.items():
        name = k.removeprefix("cmdstat_")
        out[name] = int(v["calls"]) if isinstance(v, dict) else 0
    return out


def limiter_round_trips(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Round trips per limiter command between two ``redis_calls`` readings."""
    return {
        c: after.get(c, 0) - before.get(c, 0)
        for c in LIMITER_COMMANDS
        if after.get(c, 0) - before.get(c, 0)
    }


def envoy_counters(admin_port: int, contains: str = "ext_proc") -> dict[str, int]:
    """Envoy admin counters whose name contains ``contains``."""
    url = f"http://127.0.0.1:{admin_port}/stats?filter={contains}"
    with urllib.request.urlopen(url, timeout=2) as r:  # loopback admin port
        text = r.read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def consecutive_free(n: int) -> int:
    """First of ``n`` consecutive free loopback ports."""
    for _ in range(200):
        base = free_port() if n == 1 else random.randint(20_000, 60_000)
        if all(not port_in_use(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports found")


#: Requests per second the window-boundary measurement allows (fixed and sliding windows).
BOUNDARY_RPS = 100


#: The peer section's enforcement limit (LiteLLM's per-key TPM/RPM, per minute, the same).
PEER_TPM = 2000
PEER_RPM = 1000


#: Tenants of the scale section's many-tenant runs (``sk-scale0`` ...).
SCALE_TENANTS = 64


def bench_rules(every: int = 64, tpm_limit: int = 20_000) -> dict[str, Any]:
    """Rules for the benchmarks, shaped like the end-to-end suite's: hourly windows,
    plaintext test keys, one generous tenant and a lazy and a strict tenant with ``tpm_limit``."""
    hour = "hour"
    limited = [{"model": "*", "per": hour, "rpm": 1_000_000, "tpm": tpm_limit}]
    # a money budget worth tpm_limit output tokens: $1 per million input, $4 per million output
    budget = [{"model": "*", "per": hour, "rpm": 1_000_000, "budget": tpm_limit * 4 / 1e6}]
    boundary = [{"model": "*", "per": "second", "rpm": BOUNDARY_RPS}]
    peer = [{"model": "*", "per": "minute", "rpm": PEER_RPM, "tpm": PEER_TPM}]
    return {
        "version": 1,
        "charging": {
            "mode": "stream_incremental",
            "streaming": "lazy",
            "charge_every_tokens": every,
        },
        "models": {
            "sim-small": {
                "aliases": ["sim"],
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 4096,
                "pricing": {"currency": "USD", "input": 1, "output": 4},
            }
        },
        "plans": {
            "big": {
                "limits": [{"model": "*", "per": hour, "rpm": 100_000_000, "tpm": 1_000_000_000}]
            },
            "lazy": {"limits": limited},
            "strict": {"limits": limited, "charging": {"streaming": "strict"}},
            "budget-lazy": {"limits": budget},
            "budget-strict": {"limits": budget, "charging": {"streaming": "strict"}},
            # monthly: a soak's counters outlive an hour boundary (hourly ones expire at its end)
            "soak": {"limits": [{"model": "*", "per": "month", "tpm": 10**15}]},
            "fixed": {"limits": boundary},
            "sliding": {"limits": [{**boundary[0], "window": "sliding"}]},
            # the peer section's enforcement runs: LiteLLM's per-key limit, per minute
            "peer-lazy": {"limits": peer},
            "peer-strict": {"limits": peer, "charging": {"streaming": "strict"}},
        },
        "organisations": {"bench-org": {"limits": [{"per": hour, "tpm": 1_000_000_000}]}},
        "teams": {
            "bench-team": {
                "organisation": "bench-org",
                "limits": [{"per": hour, "tpm": 1_000_000_000}],
                "end_users": {
                    "limits": [{"per": hour, "tpm": 1_000_000_000}],
                    "max_users": 1_000_000,
                    "per": hour,
                },
            }
        },
        "tenants": {
            f"t-{name}": {"plan": name, "keys": [{"name": name, "plaintext": f"sk-{name}"}]}
            for name in (
                *("lazy", "strict", "budget-lazy", "budget-strict", "fixed", "sliding"),
                *("peer-lazy", "peer-strict"),
            )
        }
        | {
            f"t-{name}": {"plan": plan, "keys": [{"name": name, "plaintext": f"sk-{name}"}]}
            for name, plan in (("bench", "big"), ("soak", "soak"))
        }
        | {  # the levels section's: a key counted at 4 levels (docs/semantics.md, "Levels")
            "t-levels": {
                "plan": "big",
                "keys": [{"name": "levels", "plaintext": "sk-levels", "team": "bench-team"}],
            }
        }
        | {  # the scale section's 64 tenants
            f"t-scale{i}": {
                "plan": "big",
                "keys": [{"name": f"scale{i}", "plaintext": f"sk-scale{i}"}],
            }
            for i in range(SCALE_TENANTS)
        },
    }


def start_stack(
    workdir: Path,
    rules: dict[str, Any],
    *,
    envoys: int = 1,
    extprocs: int = 1,
    baseline: bool = False,
    extproc_argv: Sequence[str] = (),
    env: dict[str, str] | None = None,
    redis_url: str | None = None,
    sim_max_records: int = 20_000,
    security: str = "insecure",
    sims: int = 1,
    sim_models: Sequence[str] = (),
) -> Stack:
    """Start Redis (unless ``redis_url``), the simulator, processors and Envoys on free ports.

    ``security``: the processors' port (extproc.stack.Stack.security); plaintext by default, so
    figures stay comparable with earlier runs and the do-nothing floor processor (which has
    no TLS) works; the ``door`` scenario measures TLS and credential checks against it."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "rules.yaml"
    config.write_text(yaml.safe_dump(rules, sort_keys=False))
    ports = StackPorts(
        envoy=consecutive_free(envoys),
        envoy_admin=consecutive_free(envoys),
        sim=free_port(),
        extproc=consecutive_free(extprocs),
        redis=free_port(),
    )
    stack = Stack(
        config=str(config),
        workdir=workdir,
        ports=ports,
        envoys=envoys,
        extprocs=extprocs,
        sims=sims,
        redis_url=redis_url,
        sim_args=[
            "--ttft-ms",
            "0",
            "--itl-ms",
            "0",
            "--max-records",
            str(sim_max_records),
            "--max-tokens-cap",
            "8192",
            "--log-level",
            "warning",
            *(arg for m in sim_models for arg in ("--model", m)),
        ],
        extproc_env=dict(env or {}),
        baseline_port=consecutive_free(envoys) if baseline else 0,
        extproc_argv=extproc_argv,
        security=security,
    )
    stack.start()
    time.sleep(0.2)
    return stack


def proc_pids(stack: Stack, prefix: str) -> list[int]:
    """Process ids of the stack's children whose name starts with ``prefix``."""
    return [p.popen.pid for p in stack.procs if p.name.startswith(prefix)]


def sim_records(sim_url: str, timeout_s: float = 5.0) -> list[SimRecord]:
    """The simulator's ground-truth records (its ring buffer: the newest ones)."""
    with urllib.request.urlopen(f"{sim_url}/sim/requests", timeout=timeout_s) as r:  # noqa: S310
        raw: list[dict[str, Any]] = orjson.loads(r.read())["requests"]
    return [rec for rec in map(sim_record_from_json, raw) if rec is not None]


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux ``/proc``), in MB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return 0.0
    return 0.0
