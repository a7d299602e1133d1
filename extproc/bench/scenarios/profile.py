"""Section 8, profile: py-spy on the real processor while it meters 500-chunk streams; the
functions with the most own time and the processor's entry points' inclusive time per chunk."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from extproc.bench import system
from extproc.bench.client import Shape
from extproc.bench.drivers import KEY, US, timed
from extproc.bench.plan import Bench
from extproc.bench.profiling import parse_pyspy_raw, pyspy_path
from extproc.bench.report import Row
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack


async def profile(b: Bench, main: Stack) -> None:
    """py-spy on the real processor while it meters 500-chunk streams.  Without ``--native``
    (which needs blocking sampling and shows mostly idle libc waits here) time spent in C
    extensions is charged to the Python frame that called them."""
    spy = pyspy_path()
    if spy is None:
        b.raw["profile"] = {"skipped": "py-spy not installed (pip install py-spy)"}
        b.log("profile: skipped, py-spy is not installed")
        return
    pid = system.proc_pids(main, "extproc")[0]
    rate = 250
    out = b.workdir / "pyspy.txt"
    secs = b.plan.profile_seconds
    b.log(f"profile: py-spy {secs}s at {rate} Hz on pid {pid}")
    proc = await asyncio.create_subprocess_exec(
        spy,
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--nonblocking",
        "--duration",
        str(int(secs)),
        "--output",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await asyncio.sleep(0.5)
    shape = Shape(prompt_tokens=100, max_tokens=500, stream=True, itl_ms=1)
    rs, _ = await timed(
        main.base_url, KEY, shape, seconds=secs - 0.5, concurrency=b.plan.cpu_concurrency
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), secs + 20)
    except TimeoutError:
        proc.kill()
        err = b"timeout"
    if proc.returncode != 0 or not out.exists():
        b.raw["profile"] = {"skipped": f"py-spy failed: {err.decode(errors='replace')[-300:]}"}
        return
    own, incl, mods, total = parse_pyspy_raw(out.read_text())
    chunks = sum(r.tokens for r in rs)
    us_per_sample = US / rate

    def table(c: Counter[str], k: int) -> list[dict[str, Any]]:
        return [
            {
                "function": f,
                "samples": n,
                "share": n / max(1, total),
                "us_per_chunk": n * us_per_sample / max(1, chunks),
            }
            for f, n in c.most_common(k)
        ]

    b.raw["profile"] = {
        "rate_hz": rate,
        "samples": total,
        "chunks": chunks,
        "cpu_us_per_chunk_sampled": total * us_per_sample / max(1, chunks),
        "own": table(own, 30),
        "own_by_module": table(mods, 20),
        "inclusive_extproc": table(
            Counter(
                {
                    f: n
                    for f, n in incl.items()
                    if "extproc" in f or "server/" in f or "core/" in f or "limiter/" in f
                }
            ),
            20,
        ),
    }
    for item in b.raw["profile"]["own"][:5]:
        b.table.add(
            Row(
                "8 profile",
                f"own time: {item['function']}",
                "µs/chunk",
                item["us_per_chunk"],
                note=f"{100 * item['share']:.0f}% of samples",
            )
        )
    wanted = ("ExternalProcessorServicer.Process ", "RequestProcessor.handle ")
    for item in b.raw["profile"]["inclusive_extproc"]:
        if not item["function"].startswith(wanted):
            continue
        b.table.add(
            Row(
                "8 profile",
                f"inclusive: {item['function']}",
                "µs/chunk",
                item["us_per_chunk"],
                note=f"{100 * item['share']:.0f}% of samples",
            )
        )


async def measure(b: Bench, stacks: Stacks) -> None:
    """Run on the shared main stack."""
    await profile(b, stacks.shared)


SCENARIO = Scenario("profile", measure, on_main=True)
