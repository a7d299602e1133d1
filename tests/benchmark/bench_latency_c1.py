"""Where the added latency of a non-streaming request at concurrency 1 goes (issue 27).

Arms behind real Envoys (those of ``bench_fixed_part.py``: the do-nothing ``floor``, the
``gateway``, the ``gateway-allowances``, sharing one Redis) and the same Envoy build's listener
without the filter (the ``baseline``), the bench's admission shape (a 1k-token prompt,
``max_tokens`` 8, not streamed), one request at a time, arms alternated over the rounds:

- **latency**: p50 and p99 per arm and round; each arm's *added* p50 is its median p50 minus the
  baseline's (what issue 27's "added p50 at c = 1" target reads);
- **with** ``--profile S``: per processor arm, ``py-spy record --gil`` on its process for ``S``
  seconds of the same c = 1 load (samples taken only while a thread holds the GIL: Python work
  and the parts of grpc's Cython that run under it), split by the innermost frame's source
  line into the servicer's ``context.read``, its ``context.write`` and everything else, as
  GIL-held µs per request: what the gRPC messages themselves cost a grpc.aio processor, against
  what the gateway's own work costs.

``python tests/benchmark/bench_latency_c1.py [--rounds R] [--requests N] [--profile S]
[--out F]``.  A measurement, not a test; ``pytest -m benchmark`` runs a short pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import linecache
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from extproc.bench import system
from extproc.bench.drivers import KEY, batch, pct_ms
from extproc.stack import Stack

if __package__ in (None, ""):  # run as a script: the repository root goes on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmark.bench_fixed_part import SHAPE, start_arms

PROCESSOR_ARMS = ("floor", "gateway", "gateway-allowances")
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def classify(frame: str) -> str:
    """``read``, ``write`` or ``other`` for a py-spy frame ``function (path:line)``: the
    servicer's awaited gRPC read or write when the frame's source line is one."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return "other"
    text = linecache.getline(m["file"], int(m["line"]))
    if "context.read(" in text:
        return "read"
    if "context.write(" in text or "writer.write(" in text:
        return "write"
    return "other"


def split_samples(raw: str) -> Counter[str]:
    """GIL-held samples of a ``py-spy record -f raw`` output by :func:`classify`; the event
    loop's own wait (``Runner.run``/``Thread.run`` innermost: the selector, the grpc poller
    thread's wait) is ``idle``."""
    out: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        last = stack.split(";")[-1]
        if "Runner.run" in last or "Thread.run" in last or "run_forever" in last:
            out["idle"] += int(n)
        else:
            out[classify(last)] += int(n)
    return out


async def latency(arms: dict[str, str], rounds: int, requests: int) -> dict[str, list[float]]:
    """p50 per arm and round, one request at a time (the arms alternate, reversed each round)."""
    p50: dict[str, list[float]] = {a: [] for a in arms}
    p99: dict[str, list[float]] = {f"{a}:p99": [] for a in arms}
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for a in order:
            rs = await batch(arms[a], KEY, SHAPE, count=requests, concurrency=1)
            assert all(x.status == 200 for x in rs), a
            p50[a].append(round(pct_ms(rs, 50) or 0.0, 3))
            p99[f"{a}:p99"].append(round(pct_ms(rs, 99) or 0.0, 3))
    return {**p50, **p99}


async def profile(stack: Stack, seconds: float) -> dict[str, Any]:
    """GIL-held µs per request of the arm's processor under c = 1 load (py-spy ``--gil``)."""
    pid = system.proc_pids(stack, "extproc")[0]
    spy = Path(tempfile.mkdtemp(prefix="aiq-spy-")) / "raw.txt"
    argv = [str(Path(sys.executable).with_name("py-spy")), "record", "--gil", "--nonblocking"]
    argv += ["-r", "1000", "-f", "raw", "-d", str(int(seconds)), "-p", str(pid), "-o", str(spy)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await asyncio.sleep(1.0)  # py-spy attached
    done = 0
    stop = time.monotonic() + seconds - 2.0
    while time.monotonic() < stop:
        done += len(await batch(stack.base_url, KEY, SHAPE, count=100, concurrency=1))
    await asyncio.to_thread(proc.wait, 60)
    split = split_samples(spy.read_text()) if spy.exists() else Counter()
    busy = {k: v for k, v in split.items() if k != "idle"}
    # 1000 samples a second: a sample is 1 ms of a thread holding the GIL.  The requests sent
    # while py-spy ran are those of its window (it starts before the load, stops after it).
    per = {k: round(v * 1000.0 / max(1, done), 1) for k, v in busy.items()}
    per["total"] = round(sum(busy.values()) * 1000.0 / max(1, done), 1)
    return {"requests": done, "samples": dict(split), "gil_us_per_request": per}


async def measure(rounds: int, requests: int, profile_s: float) -> dict[str, Any]:
    """Latency of every arm (and the GIL profile with ``profile_s``)."""
    workdir = Path(tempfile.mkdtemp(prefix="aiq-lat-"))
    stacks = await asyncio.to_thread(start_arms, workdir, PROCESSOR_ARMS)
    rules = system.bench_rules()
    base = await asyncio.to_thread(
        system.start_stack,
        workdir / "baseline",
        rules,
        redis_url=stacks["floor"].effective_redis_url,
        baseline=True,
        extproc_argv=(sys.executable, "-m", "extproc.bench.floor"),
    )
    try:
        urls = {
            "baseline": f"http://127.0.0.1:{base.baseline_port}/v1",
            **{a: s.base_url for a, s in stacks.items()},
        }
        for url in urls.values():
            await batch(url, KEY, SHAPE, count=50, concurrency=2)
        lat = await latency(urls, rounds, requests)
        prof = {a: await profile(s, profile_s) for a, s in stacks.items()} if profile_s else {}
    finally:
        base.stop()
        for st in stacks.values():
            st.stop()
    med = {a: statistics.median(v) for a, v in lat.items()}
    added = {a: round(med[a] - med["baseline"], 3) for a in stacks}
    return {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "requests_per_round": requests,
        "shape": {"prompt_tokens": SHAPE.prompt_tokens, "max_tokens": SHAPE.max_tokens},
        "p_ms_per_round": lat,
        "p50_ms_median": {a: med[a] for a in urls},
        "added_p50_ms": added,
        "profile": prof,
    }


@pytest.mark.benchmark
def test_latency_c1_arms_run() -> None:
    """A short pass: every arm answers, each added p50 is a number, the profile splits."""
    res = asyncio.run(measure(rounds=1, requests=10, profile_s=0))
    assert set(res["added_p50_ms"]) == set(PROCESSOR_ARMS)
    assert all(v > 0 for v in res["p50_ms_median"].values())


def main() -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--profile", type=float, default=0.0, help="py-spy seconds per arm (0: none)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    res = asyncio.run(measure(args.rounds, args.requests, args.profile))
    for a, v in res["p50_ms_median"].items():
        added = res["added_p50_ms"].get(a)
        tail = f"  added {added:+.3f} ms" if added is not None else ""
        print(f"{a:20s} p50 {v:7.3f} ms{tail}  rounds {res['p_ms_per_round'][a]}")
    for a, v in res["profile"].items():
        print(f"{a:20s} GIL-held us/request {v['gil_us_per_request']} ({v['requests']} requests)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
