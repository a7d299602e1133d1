"""One load-client process of the scale section (``extproc.bench.scenarios.scale``): several
run side by side so that the load client is not what saturates on a many-core machine.

Protocol on stdin/stdout, one line each: it prints ``ready`` once imported and connected to
nothing yet; on ``go`` it runs a closed loop for ``--seconds`` at ``--concurrency``, spreading
requests over ``--keys`` in turn, and prints one JSON line (requests, ok, tokens of the 200
answers, elapsed seconds); then it waits for stdin to close before exiting, so that the
caller can read its CPU time while it is still alive.

``python -m extproc.bench.load_proc --url URL --keys K1,K2 --shape JSON --seconds S
--concurrency C [--offset N]``
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from extproc.bench.client import Shape
from extproc.bench.drivers import ok_count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m extproc.bench.load_proc")
    p.add_argument("--url", required=True)
    p.add_argument("--keys", required=True, help="API keys, comma-separated")
    p.add_argument("--shape", required=True, help="Shape fields as a JSON object")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--offset", type=int, default=0, help="first request number (prompts differ)")
    a = p.parse_args(argv)
    shape = Shape(**orjson.loads(a.shape))
    keys = tuple(a.keys.split(","))
    from extproc.bench.scenarios.scale import timed_keys

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    rs, elapsed = asyncio.run(
        timed_keys(
            a.url, keys, shape, seconds=a.seconds, concurrency=a.concurrency, offset=a.offset
        )
    )
    out = {
        "requests": len(rs),
        "ok": ok_count(rs),
        "tokens": sum(r.tokens for r in rs if r.status == 200),
        "elapsed": elapsed,
    }
    print(orjson.dumps(out).decode(), flush=True)
    sys.stdin.read()  # until the caller closes it (it reads this process's CPU time first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
