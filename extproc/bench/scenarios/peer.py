"""Section 14, the peer: the LiteLLM proxy (pinned, its own virtualenv, its Redis-backed TPM/RPM
limits on the gateway's redis-server; :mod:`extproc.bench.peer`) against the gateway, both in
front of the same simulator, in one run with the arms alternated:

* proxy CPU per non-streaming request at c = 1 and c = 16 (the admission shape: 1k-token
  prompt, 8 output tokens): ours is Envoy's CPU plus the processor tree's, theirs the LiteLLM
  process tree's, over a batch (and a quiet 0.3 s after it, for both: work that runs after the
  response, such as settlement or LiteLLM's post-call hooks) divided by its requests;
* proxy CPU per streamed chunk: batches of 200-token streams at c = 16, the CPU over the batch
  divided by the content chunks the clients received (the whole stream's cost, its fixed part
  included); judged with 10 ms between tokens (each chunk its own ext_proc message, as from an
  engine), and reported with 1 ms (16 streams then offer more chunks than one LiteLLM worker
  handles, and Envoy reads several chunks per message: the favourable case for the gateway);
* added p50 latency at c = 1: each proxy's p50 minus the simulator's own (a third arm, straight
  to the simulator), from the same c = 1 batches;
* enforcement of one 2,000-TPM limit (per minute for both): a closed loop of clients streaming
  1,000-token answers (100-token prompts) for a few seconds inside one window, then the tokens
  the simulator served (its records: prompt + tokens written) against the limit: the gateway
  strict and lazy, LiteLLM with its token reservation (its default) and without.

Targets (issue 35): LiteLLM's CPU >= 6x ours per request and >= 5x per chunk (10 ms apart),
our added p50 <= 1/6 of LiteLLM's; the gateway's strict run 0 tokens over and >= 99 % of the limit used, the
lazy one within its bound (N per concurrent stream).  When LiteLLM cannot be installed or
started, the section is skipped with the reason in the JSON and the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import aiohttp
import orjson

from extproc.bench import peer, system
from extproc.bench.client import Result, Shape, connector, send
from extproc.bench.drivers import KEY, US, batch, interleave, med_rounds, pct_ms
from extproc.bench.plan import Bench
from extproc.bench.report import Row, Target, diff
from extproc.bench.scenarios.base import Scenario, Stacks
from extproc.stack import Stack, free_port
from extproc.stats import median

LABEL = "14 peer"
#: Issue 35's targets: LiteLLM / gateway.
CPU_PER_REQUEST_RATIO = 6.0
CPU_PER_CHUNK_RATIO = 5.0
ADDED_P50_RATIO = 6.0
#: The gateway's strict run uses at least this share of the limit (and 0 tokens over it).
STRICT_USED_PCT = 99.0

#: Non-streaming requests: the admission shape (section 1).
NON_STREAM = Shape(prompt_tokens=1000, max_tokens=8)
#: Streams: 200 tokens, 1 ms apart (LiteLLM gets the delay through its ITL1 model).
STREAM = Shape(prompt_tokens=100, max_tokens=200, stream=True, itl_ms=10)
#: The same 1 ms apart: 16 streams then offer 16,000 chunks/s, more than one LiteLLM worker
#: handles, and Envoy hands the processor several chunks per message (reported, not judged).
STREAM_ITL1 = dataclasses.replace(STREAM, itl_ms=1)
#: Enforcement: 1,000-token answers, 1 ms apart.
ENFORCE = Shape(prompt_tokens=100, max_tokens=1000, stream=True, itl_ms=1)
#: Quiet time after each CPU batch, inside the measurement (the same for both proxies).
SETTLE_S = 0.3
#: A client's pause after a refusal or a cut before its next request.
PAUSE_S = 0.25


def via_peer(shape: Shape) -> Shape:
    """The shape as sent to LiteLLM: the model name that adds the simulator's pacing header when
    the shape paces tokens (LiteLLM does not forward the client's ``x-sim-*`` headers)."""
    return dataclasses.replace(shape, model=peer.itl_model(shape.itl_ms)) if shape.itl_ms else shape


@dataclasses.dataclass
class Arm:
    """One side of a CPU comparison: where to send, which processes to meter."""

    url: str
    key: str
    meters: dict[str, system.CpuMeter]
    peer_model: bool = False
    #: Envoy's admin port (the gateway): its ext_proc messages are counted per batch
    envoy_admin: int = 0

    def shape(self, shape: Shape) -> Shape:
        """``shape`` as this arm sends it."""
        return via_peer(shape) if self.peer_model else shape


async def cpu_batch(arm: Arm, shape: Shape, count: int, concurrency: int) -> dict[str, Any]:
    """One batch: each meter's CPU over it and SETTLE_S after it, per request and per content
    chunk received; the p50 latency; failures."""
    before = system.envoy_counters(arm.envoy_admin) if arm.envoy_admin else {}
    for m in arm.meters.values():
        m.start()
    rs = await batch(arm.url, arm.key, arm.shape(shape), count=count, concurrency=concurrency)
    await asyncio.sleep(SETTLE_S)
    cpu = {name: m.stop() for name, m in arm.meters.items()}
    after = system.envoy_counters(arm.envoy_admin) if arm.envoy_admin else {}
    msgs = sum(v - before.get(k, 0) for k, v in after.items() if k.endswith("stream_msgs_sent"))
    total = sum(cpu.values())
    chunks = sum(r.tokens for r in rs)
    return {
        "requests": len(rs),
        "failed": sum(1 for r in rs if r.status != 200 or r.error or (shape.stream and not r.done)),
        "chunks": chunks,
        "cpu_s": cpu,
        "cpu_per_req_us": total / max(1, len(rs)) * US,
        "cpu_per_chunk_us": total / chunks * US if chunks else None,
        "by_process": {
            k: {
                "cpu_per_req_us": v / max(1, len(rs)) * US,
                "cpu_per_chunk_us": v / chunks * US if chunks else None,
            }
            for k, v in cpu.items()
        },
        "p50_ms": pct_ms(rs, 50),
        "ext_proc_msgs": msgs,
    }


def ratio_note(theirs: list[float | None], ours: list[float | None]) -> str:
    """The per-round LiteLLM / gateway ratios (the arms alternate, so a round's batches saw
    about the same machine): median and range."""
    rs = [t / o for t, o in zip(theirs, ours, strict=True) if t is not None and o]
    if not rs:
        return ""
    return f"ratio per round: median {median(rs):.2f}x, {min(rs):.2f}-{max(rs):.2f}x"


def cpu_rows(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> list[Row]:
    """The CPU rows: LiteLLM's figure against the gateway's (the base), ratio = LiteLLM /
    gateway with issue 35's targets, and our Envoy / processor split in the note."""
    out: list[Row] = []
    specs = (
        ("c1", "cpu_per_req_us", "proxy CPU per non-streaming request, c=1", CPU_PER_REQUEST_RATIO),
        (
            "c16",
            "cpu_per_req_us",
            "proxy CPU per non-streaming request, c=16",
            CPU_PER_REQUEST_RATIO,
        ),
        (
            "streams",
            "cpu_per_chunk_us",
            f"proxy CPU per streamed chunk, 200-token streams {STREAM.itl_ms:g} ms apart, c=16",
            CPU_PER_CHUNK_RATIO,
        ),
        (
            "streams_itl1",
            "cpu_per_chunk_us",
            f"proxy CPU per streamed chunk, 200-token streams {STREAM_ITL1.itl_ms:g} ms apart, c=16",
            None,
        ),
    )
    spec: tuple[str, str, str, float | None]
    for spec in specs:
        key, fig, name, bound = spec
        per = rounds.get(key)
        if not per:
            continue
        ours = [r[fig] for r in per["gateway"]]
        theirs = [r[fig] for r in per["litellm"]]
        split = {
            p: med_rounds([r["by_process"][p][fig] for r in per["gateway"]])
            for p in ("envoy", "processor")
        }
        note = f"ours: Envoy {split['envoy'] or 0:.0f} + processor {split['processor'] or 0:.0f} µs"
        if fig == "cpu_per_chunk_us":  # Envoy may read several chunks at once: say how many
            per_msg = med_rounds(
                [r["chunks"] / r["ext_proc_msgs"] for r in per["gateway"] if r["ext_proc_msgs"]]
            )
            if per_msg is not None:
                note += f", {per_msg:.2f} chunks per ext_proc message"
        failed = {arm: sum(r["failed"] for r in rs) for arm, rs in per.items()}
        parts = [note, ratio_note(theirs, ours)]
        if any(failed.values()):
            parts.append(f"failed: gateway {failed['gateway']}, LiteLLM {failed['litellm']}")
        out.append(
            Row(
                LABEL,
                f"{name}: LiteLLM (base = gateway, Envoy + processor)",
                "µs",
                med_rounds(theirs),
                med_rounds(ours),
                goal=None if bound is None else Target("ratio", ">=", bound),
                note=", ".join(p for p in parts if p),
            )
        )
    return out


def latency_rows(c1: dict[str, list[dict[str, Any]]]) -> list[Row]:
    """p50 at c = 1 of each proxy against the simulator direct, and the added p50s compared
    (LiteLLM's over ours: our added latency is at most 1/6 of theirs when the ratio is >= 6)."""
    p50 = {arm: med_rounds([r["p50_ms"] for r in rs]) for arm, rs in c1.items()}
    direct = p50.get("direct")
    added = {arm: diff(v, direct) for arm, v in p50.items()}
    return [
        Row(
            LABEL,
            "latency p50, c=1: gateway (base = simulator direct)",
            "ms",
            p50["gateway"],
            direct,
        ),
        Row(
            LABEL,
            "latency p50, c=1: LiteLLM (base = simulator direct)",
            "ms",
            p50["litellm"],
            direct,
        ),
        Row(
            LABEL,
            "added p50 latency, c=1: LiteLLM (base = gateway)",
            "ms",
            added["litellm"],
            added["gateway"],
            goal=Target("ratio", ">=", ADDED_P50_RATIO),
        ),
    ]


def enforcement_rows(runs: dict[str, dict[str, Any]], every: int, clients: int) -> list[Row]:
    """Per enforcement run: the share of the limit the upstream served, the tokens over it the
    upstream served and those that reached clients (a cut stream's tokens in flight reach
    the upstream's count, not the client).  The gateway's strict run must use >= 99 % and
    deliver 0 tokens over, its lazy run at most ``every`` tokens over per concurrent stream
    (docs/semantics.md: judged, as in section 5, on what reached clients); LiteLLM's runs are
    reported as found."""
    names = {
        "gateway-strict": "gateway strict",
        "gateway-lazy": f"gateway lazy (N = {every})",
        "litellm-reserve": "LiteLLM (token reservation on, its default)",
        "litellm-noreserve": "LiteLLM (token reservation off)",
    }
    used_goal = {"gateway-strict": Target("value", ">=", STRICT_USED_PCT, "%")}
    delivered_goal = {
        "gateway-strict": Target("value", "<=", 0, "tokens"),
        "gateway-lazy": Target("value", "<=", every * clients, "tokens"),
    }
    out: list[Row] = []
    for arm, label in names.items():
        run = runs.get(arm)
        if run is None:
            continue
        fig = run["figures"]
        head = f"TPM {fig['limit']:,.0f}/min"
        note = (
            f"served {fig['served']:,.0f} of {fig['limit']:,.0f}; requests answered "
            f"{run['admitted']}, refused {run['refused']}, cut {run['cut']}"
        )
        out += [
            Row(
                LABEL,
                f"{head}, tokens the upstream served / limit: {label}",
                "%",
                fig["used_pct"],
                goal=used_goal.get(arm),
                note=note,
            ),
            Row(LABEL, f"{head}, tokens over it, upstream: {label}", "tokens", fig["over"]),
            Row(
                LABEL,
                f"{head}, tokens over it, delivered to clients: {label}",
                "tokens",
                fig.get("over_delivered"),
                goal=delivered_goal.get(arm),
            ),
        ]
    return out


async def closed_loop(
    url: str, key: str, shape: Shape, *, clients: int, seconds: float
) -> list[Result]:
    """``clients`` workers, each sending the next request as soon as its last one ended (after
    PAUSE_S when it was refused or cut), none started after ``seconds``."""
    out: list[Result] = []
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=connector(clients)) as session:

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                n += 1
                r = await send(session, url, key, shape, body=shape.body(w * 1_000_000 + n))
                out.append(r)
                if r.status != 200 or r.cut:
                    await asyncio.sleep(PAUSE_S)

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return out


def clear_sim(stack: Stack) -> None:
    """Empty the simulator's ground-truth buffer (its running totals are kept)."""
    req = urllib.request.Request(f"{stack.sim_url}/sim/requests", method="DELETE")  # noqa: S310
    with urllib.request.urlopen(req, timeout=5):  # noqa: S310 - loopback
        pass


def sim_requests(stack: Stack) -> list[dict[str, Any]]:
    """The simulator's ground-truth records, raw (see :func:`peer.served_tokens`)."""
    with urllib.request.urlopen(f"{stack.sim_url}/sim/requests", timeout=5) as r:  # noqa: S310
        out: list[dict[str, Any]] = orjson.loads(r.read())["requests"]
    return out


async def enforce_run(
    b: Bench, stack: Stack, url: str, key: str, shape: Shape, *, minute_aligned: bool
) -> dict[str, Any]:
    """One enforcement run inside one window: the gateway's windows are fixed minutes (wait
    for a fresh one if this one would end during the run); LiteLLM's start at the key's first
    request (a fresh key each run)."""
    seconds = b.plan.peer_enforce_s
    if minute_aligned:
        left = 60 - time.time() % 60
        if left < seconds + 8:
            b.log(f"peer: waiting {left:.0f}s for the next minute window")
            await asyncio.sleep(left + 0.5)
    await asyncio.to_thread(clear_sim, stack)
    rs = await closed_loop(url, key, shape, clients=b.plan.peer_clients, seconds=seconds)
    await asyncio.sleep(0.5)
    records = await asyncio.to_thread(sim_requests, stack)
    served = peer.served_tokens(records)
    prompts = sum(int(r.get("prompt_tokens", 0)) for r in records)
    delivered = prompts + sum(r.tokens for r in rs)
    return {
        "requests": len(rs),
        "admitted": sum(1 for r in rs if r.status == 200),
        "refused": sum(1 for r in rs if r.status == 429),
        "other_status": sum(1 for r in rs if r.status not in (200, 429)),
        "cut": sum(1 for r in rs if r.cut),
        "delivered_chunks": sum(r.tokens for r in rs),
        "upstream_requests": len(records),
        "figures": peer.enforcement(served, peer.LIMITED_TPM, delivered),
    }


async def measure(b: Bench, stacks: Stacks) -> None:
    """Install (first use) and start LiteLLM next to a gateway stack of its own; measure."""
    raw: dict[str, Any] = b.raw.setdefault(
        "peer", {"litellm": peer.LITELLM_VERSION, "venv": str(peer.VENV)}
    )
    try:
        if not peer.installed():
            b.log(f"peer: installing {peer.PIN} into {peer.VENV} (first use)")
        command = await asyncio.to_thread(peer.ensure_venv)
    except peer.PeerUnavailable as exc:
        raw["skipped"] = f"LiteLLM unavailable: {exc}"
        b.log(f"peer: skipped, {exc}")
        return
    b.log("peer: starting a gateway stack and LiteLLM on its simulator and Redis")
    stack = await stacks.start("peer")
    start: Callable[[bool], Awaitable[peer.Peer]] = partial(_start_peer, b, stack, command)
    try:
        litellm = await start(True)
    except peer.PeerUnavailable as exc:
        raw["skipped"] = f"LiteLLM did not start: {exc}"
        b.log(f"peer: skipped, {exc}")
        return
    try:
        await _compare(b, stack, litellm, raw)
        enforcement: dict[str, Any] = {}
        raw["enforcement"] = enforcement
        await _enforce(b, stack, litellm, enforcement, include_gateway=True)
    finally:
        litellm.stop()
    try:
        litellm = await start(False)
    except peer.PeerUnavailable as exc:
        raw["enforcement_noreserve_skipped"] = str(exc)
    else:
        try:
            await _enforce(b, stack, litellm, enforcement, include_gateway=False)
        finally:
            litellm.stop()
    for row in enforcement_rows(enforcement, b.plan.every, b.plan.peer_clients):
        b.table.add(row)
    stack.stop()


async def _start_peer(b: Bench, stack: Stack, command: Any, reservation: bool) -> peer.Peer:
    name = "peer-litellm" + ("" if reservation else "-noreserve")
    b.log(f"peer: starting LiteLLM {peer.LITELLM_VERSION} (token reservation {reservation})")
    started = time.perf_counter()
    p = await asyncio.to_thread(
        peer.start,
        command,
        b.workdir / name,
        sim_port=stack.ports.sim,
        redis_port=stack.ports.redis,
        port=free_port(),
        reservation=reservation,
    )
    b.raw["peer"].setdefault("start_s", []).append(round(time.perf_counter() - started, 1))
    return p


async def _compare(b: Bench, stack: Stack, litellm: peer.Peer, raw: dict[str, Any]) -> None:
    envoy = system.proc_pids(stack, "envoy")
    processor = system.proc_pids(stack, "extproc")
    gateway = Arm(
        stack.base_url,
        KEY,
        {"envoy": system.CpuMeter(envoy), "processor": system.CpuMeter(processor)},
        envoy_admin=stack.ports.envoy_admin,
    )
    theirs = Arm(litellm.base_url, KEY, {"litellm": system.CpuMeter([litellm.pid])}, True)
    direct = Arm(f"{stack.sim_url}/v1", KEY, {})
    for arm in (gateway, theirs):  # warm both: connections, caches, the limiter's scripts
        await batch(arm.url, KEY, arm.shape(NON_STREAM), count=40, concurrency=4)
        await batch(arm.url, KEY, arm.shape(STREAM), count=8, concurrency=4)
    # what each proxy burns with no traffic (part of every batch's quiet SETTLE_S)
    idle: dict[str, float] = {}
    for name, arm in (("gateway", gateway), ("litellm", theirs)):
        for m in arm.meters.values():
            m.start()
        await asyncio.sleep(2.0)
        idle[name] = sum(m.stop() for m in arm.meters.values()) / 2.0 * 100
    raw["idle_cpu_pct"] = idle
    p = b.plan
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    plans = (
        ("c1", NON_STREAM, p.peer_c1, 1, {"direct": direct, "gateway": gateway, "litellm": theirs}),
        ("c16", NON_STREAM, p.peer_c16, 16, {"gateway": gateway, "litellm": theirs}),
        ("streams", STREAM, p.peer_streams, 16, {"gateway": gateway, "litellm": theirs}),
        ("streams_itl1", STREAM_ITL1, p.peer_streams, 16, {"gateway": gateway, "litellm": theirs}),
    )
    for key, shape, count, conc, arms in plans:
        b.log(f"peer: {key}, {count} requests at c={conc} per arm x {p.rounds} rounds")
        rounds[key] = await interleave(
            p.rounds,
            {name: partial(cpu_batch, arm, shape, count, conc) for name, arm in arms.items()},
        )
    raw["rounds"] = rounds
    raw["shapes"] = {
        "non_stream": {"prompt_tokens": NON_STREAM.prompt_tokens, "max_tokens": 8},
        "stream": {"prompt_tokens": STREAM.prompt_tokens, "tokens": 200, "itl_ms": [10, 1]},
    }
    raw["litellm_rss_mb"] = system.rss_mb(litellm.pid)
    for row in (*cpu_rows(rounds), *latency_rows(rounds["c1"])):
        b.table.add(row)


async def _enforce(
    b: Bench,
    stack: Stack,
    litellm: peer.Peer,
    out: dict[str, Any],
    *,
    include_gateway: bool,
) -> None:
    clients, secs = b.plan.peer_clients, b.plan.peer_enforce_s
    if include_gateway:
        for mode in ("strict", "lazy"):
            b.log(f"peer: enforcement, gateway {mode}: {clients} clients for {secs:g}s")
            out[f"gateway-{mode}"] = await enforce_run(
                b, stack, stack.base_url, f"sk-peer-{mode}", ENFORCE, minute_aligned=True
            )
    arm = "litellm-reserve" if litellm.reservation else "litellm-noreserve"
    b.log(f"peer: enforcement, {arm}: {clients} clients for {secs:g}s")
    key = f"{peer.LIMITED_PREFIX}{arm}-{int(time.time())}"
    out[arm] = await enforce_run(
        b, stack, litellm.base_url, key, via_peer(ENFORCE), minute_aligned=False
    )


SCENARIO = Scenario("peer", measure)
