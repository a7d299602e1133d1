"""Instructions per non-streaming request, counted by valgrind (callgrind): a figure the load of
a shared machine does not move (issue 35).

CPU time per request on the shared 2-vCPU development machine moves by 20-40 % between rounds
when other suites run, more than most single levers change it.  This counts the instructions the
processor executes per request instead: the request path of ``bench_request.py`` (the servicer on
``FakeContext``: real protobufs, the real gateway on a real ``redis-server``, the usage-record
writer, metrics and JSON info logging), in one process run under ``valgrind --tool=callgrind``
with instrumentation off until the warm-up is done; the measured batch (its settlements
included) is counted alone: callgrind_control zeroes the counters, switches instrumentation on,
and dumps them at the end.  Instructions are not time (cache misses and branch mispredictions
are not in them), but for a change to the processor's own Python work they follow it, and two
runs of the same tree agree within about 1 %.

``python tests/benchmark/bench_instructions.py [--requests N] [--no-allowances] [--floor]
[--tree DIR]`` prints the JSON (``--tree``: run another tree's ``extproc``, e.g. a ``git
archive`` of the base revision with its ``extproc/_gen`` copied in).  About a minute per run.
``--floor``: the do-nothing processor's servicer in place of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

_HERE = Path(__file__).resolve()
_ROOT = _HERE.parents[2]


def _control(*args: str) -> None:
    """Run ``callgrind_control`` on this process (natively: children are not traced).  The loop
    stands still meanwhile, so that what it would run is not counted; the program must keep
    running for callgrind to read its command file: a short blocking sleep per poll."""
    proc = subprocess.Popen(
        ["callgrind_control", *args, str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while proc.poll() is None:
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} failed")


async def measured(requests: int, allowances: bool, floor: bool) -> None:
    """Inside valgrind: warm up, then count one batch of ``requests`` requests."""
    from extproc.bench.floor import FloorServicer
    from extproc.bench.limiter_micro import _start_redis
    from extproc.server.servicer import ExternalProcessorServicer
    from tests.benchmark.bench_chunk import _settled, run_streams
    from tests.benchmark.bench_request import open_gateway, request_messages

    with tempfile.TemporaryDirectory(prefix="aiq-instr-") as tmp:
        proc, port = _start_redis(Path(tmp))
        gw, lim, _, recorder = open_gateway(f"redis://127.0.0.1:{port}/0", allowances=allowances)
        process = FloorServicer().Process if floor else ExternalProcessorServicer(gw).Process
        try:
            serial = 0

            async def batch(n: int) -> None:
                nonlocal serial
                reqs = [request_messages(serial + i) for i in range(1, n + 1)]
                serial += n
                ctxs = await run_streams(process, reqs, 4)
                if not floor:
                    await _settled(gw)
                if any(c.written != 4 for c in ctxs):
                    raise RuntimeError("a request did not get its four replies")

            await batch(200)  # connections, scripts, allowances, caches
            gc.collect()
            gc.freeze()
            _control("-z")
            _control("-i", "on")
            await batch(requests)
            _control("-d", "measured")
            _control("-i", "off")
            await gw.background.drain_settlements(5.0)
        finally:
            await lim.close()
            await recorder.close()
            proc.terminate()
            proc.wait(10)


def _summary(path: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def count(requests: int, allowances: bool, floor: bool, tree: Path) -> dict[str, Any]:
    """Run one measurement under valgrind; instructions per request of the counted batch."""
    with tempfile.TemporaryDirectory(prefix="aiq-cg-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        argv = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--cache-sim=no",
            f"--callgrind-out-file={out}",
            f"--log-file={os.path.join(tmp, 'valgrind.log')}",
            sys.executable,
            str(_HERE),
            "--inside",
            "--requests",
            str(requests),
            *(["--no-allowances"] if not allowances else []),
            *(["--floor"] if floor else []),
        ]
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{_ROOT}"}
        t0 = time.monotonic()
        subprocess.run(argv, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
        dumps = [p for p in glob.glob(out + "*") if p != out]
        if len(dumps) != 1:
            raise RuntimeError(f"expected one dump of the measured batch, found {dumps}")
        instructions = _summary(dumps[0])
    return {
        "tree": str(tree),
        "arm": "floor" if floor else "gateway",
        "allowances": allowances,
        "requests": requests,
        "instructions_per_request": round(instructions / requests),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line (``--inside``: the process valgrind runs)."""
    p = argparse.ArgumentParser(prog="python tests/benchmark/bench_instructions.py")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--no-allowances", action="store_true")
    p.add_argument("--floor", action="store_true", help="the do-nothing processor instead")
    p.add_argument("--tree", type=Path, default=_ROOT, help="the tree whose extproc runs")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inside:
        from extproc.logs import configure_logging

        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # JSON info lines rendered, as the server does, not shown
        configure_logging("json", "info")
        import uvloop

        uvloop.install()
        try:
            asyncio.run(measured(args.requests, not args.no_allowances, args.floor))
        except BaseException:
            os.dup2(saved, 2)
            raise
        return 0
    res = count(args.requests, not args.no_allowances, args.floor, args.tree.resolve())
    print(orjson.dumps(res, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
