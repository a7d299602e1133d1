"""The scale section's load-client processes (extproc.bench.load_proc) against real
simulators: each client says it is ready before it sends anything, runs its closed loop on
``go`` for the time asked, reports what it saw as one JSON line, and stays alive (its CPU time
readable) until its stdin closes.  Two simulator processes share one port (``--reuse-port``,
as the scale section starts them): both serve, and their records add up to the requests."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import orjson
import pytest

from extproc.stack import free_port, port_in_use

pytestmark = pytest.mark.integration


async def test_load_client_processes_run_on_go_and_report() -> None:
    port = free_port()
    argv = ["-m", "extproc.sim", "--port", str(port), "--itl-ms", "0", "--ttft-ms", "0"]
    sims = [
        await asyncio.create_subprocess_exec(sys.executable, *argv, "--reuse-port")
        for _ in range(2)
    ]
    clients: list[asyncio.subprocess.Process] = []
    try:
        deadline = time.monotonic() + 30
        while not port_in_use(port):  # (the first to listen; the second joins it)
            assert time.monotonic() < deadline, "the simulator never listened"
            await asyncio.sleep(0.05)
        shape = orjson.dumps({"prompt_tokens": 50, "max_tokens": 20, "stream": True}).decode()
        for i in range(2):
            clients.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "extproc.bench.load_proc",
                    "--url",
                    f"http://127.0.0.1:{port}/v1",
                    "--keys",
                    "sk-a,sk-b",
                    "--shape",
                    shape,
                    "--seconds",
                    "1",
                    "--concurrency",
                    "2",
                    "--offset",
                    str(i * 100_000),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        for p in clients:
            assert p.stdout is not None
            assert await asyncio.wait_for(p.stdout.readline(), 60) == b"ready\n"
        for p in clients:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            await p.stdin.drain()
        total = 0
        for p in clients:
            assert p.stdout is not None
            report = orjson.loads(await asyncio.wait_for(p.stdout.readline(), 60))
            total += report["requests"]
            assert report["requests"] > 0
            assert report["ok"] == report["requests"]
            assert report["tokens"] == 20 * report["ok"]  # every stream's chunks counted
            assert 1.0 <= report["elapsed"] < 30
            assert p.returncode is None  # alive until its stdin closes
        for p in clients:
            assert p.stdin is not None
            p.stdin.close()
            assert await asyncio.wait_for(p.wait(), 30) == 0
        # each simulator process keeps its own records: fresh connections reach both
        seen: dict[bytes, int] = {}
        async with aiohttp.ClientSession() as http:
            for _ in range(40):
                async with http.get(
                    f"http://127.0.0.1:{port}/sim/requests", headers={"connection": "close"}
                ) as r:
                    recs = (await r.json())["requests"]
                seen[orjson.dumps(recs, option=orjson.OPT_SORT_KEYS)] = len(recs)
                if len(seen) == 2:
                    break
        assert len(seen) == 2, "one simulator process served everything"
        assert sum(seen.values()) == total
    finally:
        for p in [*clients, *sims]:
            if p.returncode is None:
                p.kill()
                await p.wait()
