"""Rolling restart under load: steady streaming and non-streaming traffic through one Envoy while
one processor replica is drained (SIGTERM) or killed (SIGKILL), gone, restarted and back in
rotation.  Counts the client-visible failures of each phase.

Used by the fault-injection tests (``tests/faults/``) and by the ``rolling`` bench section.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from extproc.stack import Stack

Phase = Literal["before", "fault", "gone", "back"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it (times are ``time.monotonic()``)."""

    started: float
    ended: float
    stream: bool
    ok: bool
    status: int
    detail: str = ""


@dataclass
class RollingResult:
    """What a rolling restart did to the clients."""

    how: str
    outcomes: list[Outcome] = field(default_factory=list)
    fault_at: float = 0.0  # the signal was sent
    gone_at: float = 0.0  # the replica's process had exited
    back_at: float = 0.0  # Envoy had the restarted replica in rotation again
    in_flight_at_fault: int = 0

    @property
    def failed(self) -> list[Outcome]:
        """Requests that did not end well (non-2xx, no ``[DONE]``, an error event, a reset)."""
        return [o for o in self.outcomes if not o.ok]

    def phase(self, o: Outcome) -> Phase:
        """When a request *started*: before the signal, while the replica drained or died,
        while it was gone, or after it was back."""
        if o.started < self.fault_at:
            return "before"
        if o.started < self.gone_at:
            return "fault"
        if o.started < self.back_at:
            return "gone"
        return "back"

    def summary(self) -> dict[str, object]:
        """Counts by phase and the failures' details, for reports and assertion messages."""
        by: dict[str, list[int]] = {p: [0, 0] for p in ("before", "fault", "gone", "back")}
        for o in self.outcomes:
            by[self.phase(o)][0] += 1
            if not o.ok:
                by[self.phase(o)][1] += 1
        return {
            "how": self.how,
            "requests": len(self.outcomes),
            "failed": len(self.failed),
            "in_flight_at_fault": self.in_flight_at_fault,
            "by_phase": {p: {"requests": n, "failed": f} for p, (n, f) in by.items()},
            "drain_s": round(self.gone_at - self.fault_at, 3),
            "back_s": round(self.back_at - self.gone_at, 3),
            "failures": [
                f"{'stream' if o.stream else 'plain'} {o.status} {o.detail} "
                f"(started {o.started - self.fault_at:+.3f}s)"
                for o in self.failed[:20]
            ],
        }


async def one_request(
    session: aiohttp.ClientSession, url: str, key: str, *, stream: bool, max_tokens: int
) -> Outcome:
    """Send one chat completion; well-formed end required (``[DONE]`` and no error event)."""
    body = {
        "model": "sim-small",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    t0 = time.monotonic()
    status, detail, ok = 0, "", False
    try:
        async with session.post(
            f"{url}/chat/completions",
            data=orjson.dumps(body),
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        ) as r:
            status = r.status
            raw = await r.read()
            if status != 200:
                detail = raw[:200].decode(errors="replace")
            elif stream:
                text = raw.decode(errors="replace")
                ok = "data: [DONE]" in text and '"error"' not in text
                if not ok:
                    detail = "stream ended badly: " + text[-200:]
            else:
                ok = bool(orjson.loads(raw).get("choices"))
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    return Outcome(t0, time.monotonic(), stream, ok, status, detail)


async def steady_load(
    url: str,
    key: str,
    *,
    concurrency: int,
    stop: asyncio.Event,
    out: list[Outcome],
    in_flight: list[int],
    max_tokens: int = 40,
) -> None:
    """``concurrency`` clients, half streaming, each sending its next request when the last
    ends, until ``stop`` is set; outcomes are appended to ``out``."""
    timeout = aiohttp.ClientTimeout(total=30)
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def client(i: int) -> None:
            while not stop.is_set():
                in_flight[0] += 1
                try:
                    o = await one_request(
                        session, url, key, stream=i % 2 == 0, max_tokens=max_tokens
                    )
                finally:
                    in_flight[0] -= 1
                out.append(o)

        await asyncio.gather(*(client(i) for i in range(concurrency)))


async def rolling_restart(
    stack: Stack,
    *,
    key: str,
    replica: str = "extproc1",
    how: Literal["term", "kill"] = "term",
    concurrency: int = 30,
    warmup_s: float = 1.0,
    gone_s: float = 1.0,
    after_s: float = 1.0,
) -> RollingResult:
    """Steady load through the stack's first Envoy while ``replica`` is drained (``term``) or
    killed (``kill``), stays down ``gone_s``, is restarted and put back in rotation."""
    res = RollingResult(how=how)
    stop = asyncio.Event()
    in_flight = [0]
    load = asyncio.create_task(
        steady_load(
            stack.base_url,
            key,
            concurrency=concurrency,
            stop=stop,
            out=res.outcomes,
            in_flight=in_flight,
        )
    )
    try:
        await asyncio.sleep(warmup_s)
        res.in_flight_at_fault = in_flight[0]
        res.fault_at = time.monotonic()
        stack.signal(replica, signal.SIGTERM if how == "term" else signal.SIGKILL)
        await asyncio.to_thread(stack.proc(replica).popen.wait, 60)
        res.gone_at = time.monotonic()
        await asyncio.sleep(gone_s)
        port = int(stack.proc(replica).env["AIQ_GRPC_ADDRESS"].rsplit(":", 1)[1])
        stack.restart(replica)
        await asyncio.to_thread(stack.wait_extprocs_healthy, 0, [port], 30.0)
        res.back_at = time.monotonic()
        await asyncio.sleep(after_s)
    finally:
        stop.set()
        await load
    return res


async def bench_section(bench: Any, stack: Stack, key: str) -> None:
    """The ``rolling`` bench section: failed requests while one of two replicas is drained and
    restarted, then killed and restarted (``bench`` is an ``extproc.bench.plan.Bench``)."""
    from extproc.bench.report import Row

    raw: dict[str, Any] = {}
    cases: tuple[tuple[Literal["term", "kill"], str], ...] = (
        ("term", "extproc1"),
        ("kill", "extproc0"),
    )
    for how, replica in cases:
        res = await rolling_restart(stack, key=key, replica=replica, how=how, concurrency=30)
        s = res.summary()
        raw[how] = s
        bench.table.add(
            Row(
                "8 rolling",
                f"failed requests, one of 2 replicas {'drained' if how == 'term' else 'killed'}"
                " and restarted",
                "requests",
                float(len(res.failed)),
                target="0" if how == "term" else f"<= in flight on it ({res.in_flight_at_fault})",
                met=(len(res.failed) == 0)
                if how == "term"
                else all(o.started < res.gone_at for o in res.failed),
                note=f"{s['requests']} requests, 30 clients; drain {s['drain_s']} s, "
                f"back in rotation {s['back_s']} s after exit",
            )
        )
    bench.raw["rolling"] = raw
