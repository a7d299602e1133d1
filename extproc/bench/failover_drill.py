"""Redis failover drills on the path users take: real clients through a real Envoy and the
processor, on a real Sentinel group or Cluster, the simulator's own records as the truth.

``clients`` closed-loop clients (``stream_share`` of their requests streams, 10 ms between
tokens) and a prober (one small non-stream request every ``probe_every_s``) send requests for
one busy tenant through Envoy; ``fault_at_s`` into the load the fault is made (the master
SIGKILLed, frozen, ...); the load goes on ``after_s`` past the promotion.  No request is ever
sent again: a request that fails is counted as failed, exactly as its client would see it.

At the end, once every ledger of the tenant is settled, the tenant's TPM counter on the
(new) master is compared with the simulator's records: each request's prompt tokens plus the
tokens it really sent, for the answers it gave with a 2xx status.  ``lost``: truth - counter
when positive, ``doubled``: counter - truth when positive.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
import yaml

from extproc.bench.redis_ha import HaCluster, SentinelGroup, spawn
from extproc.stack import Stack, StackPorts, free_port, port_in_use

TENANT = "t-ha"
KEY = "sk-ha"
PROBE_TENANT = "t-probe"
PROBE_KEY = "sk-probe"
SIM_ARGS = ["--ttft-ms", "5", "--itl-ms", "2"]
#: The busy tenant's daily token limit in the strict drill: reached about 3 s after the
#: master's kill (0.7 s after the promotion) at the drill's pace on the development machine.
STRICT_TPM = 10_000
PROMPT = [{"role": "user", "content": "Tell me a story about quotas and failovers."}]


def drill_rules(*, strict: bool = False, tpm: int = 10_000_000) -> dict[str, Any]:
    """Rules of the drills: the busy tenant (plan ``drill``: ``tpm`` tokens a day, strict
    streams with ``strict``) and the prober's tenant (plan ``probe``: no limit it can reach)."""
    plan: dict[str, Any] = {"limits": [{"model": "*", "per": "day", "rpm": 10_000_000, "tpm": tpm}]}
    if strict:
        plan["charging"] = {"streaming": "strict"}
    probe = {"limits": [{"model": "*", "per": "day", "rpm": 10_000_000, "tpm": 10_000_000}]}
    return {
        "version": 1,
        "charging": {"mode": "stream_incremental", "streaming": "lazy", "charge_every_tokens": 16},
        "models": {
            "sim-small": {
                "aliases": ["sim"],
                "tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"},
                "max_output_tokens": 1024,
            }
        },
        "plans": {"drill": plan, "probe": probe},
        "tenants": {
            TENANT: {"plan": "drill", "keys": [{"name": "ha", "plaintext": KEY}]},
            PROBE_TENANT: {"plan": "probe", "keys": [{"name": "probe", "plaintext": PROBE_KEY}]},
        },
    }


def start_stack(
    workdir: Path, redis_url: str, rules: dict[str, Any], env: dict[str, str] | None = None
) -> Stack:
    """One Envoy, one processor and the simulator on free ports, on ``redis_url``."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "rules.yaml"
    config.write_text(yaml.safe_dump(rules))

    def free_run(n: int) -> int:
        while True:
            p = free_port()
            if all(not port_in_use(p + i) for i in range(n)):
                return p

    stack = Stack(
        config=str(config),
        workdir=workdir,
        ports=StackPorts(
            envoy=free_run(1),
            envoy_admin=free_run(1),
            sim=free_port(),
            extproc=free_run(1),
            redis=free_port(),
        ),
        redis_url=redis_url,
        sim_args=SIM_ARGS,
        extproc_env=env or {},
    )
    stack.start()
    return stack


@dataclass
class Outcome:
    """One request as its client saw it."""

    started: float
    ended: float
    status: int  # HTTP status; 0: the connection broke
    stream: bool
    cut: bool = False  # a 200 stream that ended without its [DONE]
    error: str = ""
    probe: bool = False
    tokens: int = 0  # output tokens the client received (a stream's content events)
    rid: str = ""  # its x-client-request-id, as the simulator records it
    tail: str = ""  # a cut stream's last bytes (its error event), for the dump


@dataclass
class DrillReport:
    """What a drill measured (figures for the docs and the bench)."""

    topology: str
    fault: str
    requests: int = 0
    failed: int = 0  # answered with a non-2xx status or broken before an answer
    cut_streams: int = 0
    probes: int = 0
    probes_failed: int = 0
    fault_to_promotion_s: float = 0.0
    p99_before_ms: float = 0.0
    p99_window_ms: float = 0.0  # requests started in [fault, promotion + 1 s]
    max_window_ms: float = 0.0
    truth: int = 0
    counter: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return max(0, self.truth - self.counter)

    @property
    def doubled(self) -> int:
        return max(0, self.counter - self.truth)

    @property
    def added_p99_s(self) -> float:
        return max(0.0, (self.p99_window_ms - self.p99_before_ms) / 1000.0)

    def summary(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "fault": self.fault,
            "requests": self.requests,
            "failed": self.failed,
            "cut_streams": self.cut_streams,
            "probes": self.probes,
            "probes_failed": self.probes_failed,
            "fault_to_promotion_s": round(self.fault_to_promotion_s, 2),
            "p99_before_ms": round(self.p99_before_ms, 1),
            "p99_window_ms": round(self.p99_window_ms, 1),
            "max_window_ms": round(self.max_window_ms, 1),
            "added_p99_s": round(self.added_p99_s, 2),
            "truth_tokens": self.truth,
            "counter_tokens": self.counter,
            "lost": self.lost,
            "doubled": self.doubled,
            "errors": dict(self.errors),
            **self.notes,
        }


async def _one(
    c: httpx.AsyncClient, url: str, key: str, stream: bool, tokens: int, *, probe: bool
) -> Outcome:
    body: dict[str, Any] = {
        "model": "sim-small",
        "messages": PROMPT,
        "max_tokens": tokens,
        "stream": stream,
    }
    rid = f"r{next(_RIDS)}"
    headers = {"authorization": f"Bearer {key}", "x-sim-itl-ms": "10", "x-client-request-id": rid}
    started = time.monotonic()
    status = 0
    cut = False
    error = ""
    data = b""
    try:
        async with c.stream(
            "POST", f"{url}/chat/completions", headers=headers, content=orjson.dumps(body)
        ) as r:
            status = r.status_code
            async for chunk in r.aiter_bytes():
                data += chunk if (stream or status >= 300) else b""
            if status >= 300:
                error = _error_code(data)
            elif stream and b"data: [DONE]" not in data:
                cut = True
                error = _error_code(data) or "no [DONE]"
    except httpx.HTTPError as exc:
        cut = stream and status == 200
        # a cut stream's own error event names its reason, the broken connection after it not
        error = (_error_code(data) if b"event: error" in data else "") or type(exc).__name__
    got = _content_events(data) if stream and status == 200 else 0
    tail = data[-400:].decode(errors="replace") if cut else ""
    return Outcome(started, time.monotonic(), status, stream, cut, error, probe, got, rid, tail)


_RIDS = itertools.count(1)


def _content_events(data: bytes) -> int:
    """The SSE events of ``data`` that carry output text (one token each from the simulator)."""
    n = 0
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            for choice in orjson.loads(line[6:]).get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    n += 1
    return n


def _error_code(data: bytes) -> str:
    for marker in (b'"code":"', b'"code": "', b'"type":"', b'"type": "'):
        i = data.find(marker)
        if i >= 0:
            j = data.find(b'"', i + len(marker))
            return data[i + len(marker) : j].decode(errors="replace")
    return data[:80].decode(errors="replace")


async def _load(
    url: str,
    *,
    clients: int,
    stream_share: float,
    stop: asyncio.Event,
    out: list[Outcome],
    probe_every_s: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async with httpx.AsyncClient(timeout=60, limits=limits) as c:

        async def client() -> None:
            while not stop.is_set():
                stream = rng.random() < stream_share
                tokens = rng.randint(40, 200) if stream else rng.randint(5, 40)
                out.append(await _one(c, url, KEY, stream, tokens, probe=False))

        async def prober() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                out.append(await _one(c, url, PROBE_KEY, False, 5, probe=True))
                await asyncio.sleep(max(0.0, probe_every_s - (time.monotonic() - t0)))

        await asyncio.gather(*(client() for _ in range(clients)), prober())


def truth_of(sim_url: str, tenant: str) -> tuple[int, int]:
    """(the tenant's tokens by the simulator's records, records): prompt tokens plus the
    tokens sent, for each 2xx answer."""
    recs = httpx.get(f"{sim_url}/sim/requests", timeout=30).json()["requests"]
    mine = [r for r in recs if r["tenant"] == tenant]
    total = sum(
        r["prompt_tokens"] + (r["tokens_sent"] if 200 <= (r["status"] or 0) < 300 else 0)
        for r in mine
    )
    return total, len(mine)


def limit_figures(
    report: DrillReport,
    outs: list[Outcome],
    sim_url: str,
    limit: int,
    fault_at: float,
    *,
    config: Path,
) -> None:
    """A limited tenant's figures, in ``report.notes``, each request matched with the
    simulator's record of it by its client request id.

    ``used_upstream``: each 2xx answer's prompt plus every token the simulator sent, cut streams
    included (``over_upstream`` = that - ``limit``): an upper bound, since it also counts the
    tokens the simulator sent that the gateway held back at a cut (``held_back``: the
    simulator's count minus what the client received, over the cut streams).
    ``used_client``: what the tenant was delivered, as it is billed: a complete answer its
    prompt and output by the simulator's records, a cut stream the tokens its client received
    and its prompt as the gateway counts it (the upstream's usage never came; the simulator's
    figure leaves out the role tokens); ``over_client`` = that - ``limit``.  This is also the
    drill's truth (``report.truth``) for lost and doubled.  ``refused`` (429),
    ``cut_at_limit``, ``cut_backend`` (cut for ``quota_backend_unavailable``),
    ``exhausted_after_fault_s``: when the first refused request started, from the fault."""
    from extproc.config import load_config
    from extproc.core.apis.openai.counting import count_chat_request

    model = load_config(str(config)).models["sim-small"]
    counted = count_chat_request({"messages": PROMPT}, model.counter, model.tokenizer)
    recs = httpx.get(f"{sim_url}/sim/requests", timeout=30).json()["requests"]
    by_rid = {r["client_request_id"]: r for r in recs if r["tenant"] == TENANT}
    used_upstream = used_client = held_back = 0
    for o in outs:
        r = by_rid.get(o.rid)
        if o.probe or r is None or not 200 <= (r["status"] or 0) < 300:
            continue
        used_upstream += r["prompt_tokens"] + r["tokens_sent"]
        if o.cut:
            used_client += counted + o.tokens
            held_back += r["tokens_sent"] - o.tokens
        else:
            used_client += r["prompt_tokens"] + r["tokens_sent"]
    refused = [o for o in outs if not o.probe and o.status == 429]
    report.truth = used_client
    report.notes.update(
        limit=limit,
        used_upstream=used_upstream,
        over_upstream=used_upstream - limit,
        held_back=held_back,
        used_client=used_client,
        over_client=used_client - limit,
        refused=len(refused),
        cut_at_limit=sum(1 for o in outs if o.cut and o.error != "quota_backend_unavailable"),
        cut_backend=sum(1 for o in outs if o.cut and o.error == "quota_backend_unavailable"),
        exhausted_after_fault_s=round(min(o.started for o in refused) - fault_at, 2)
        if refused
        else None,
    )


def counter_of(
    client: redis.Redis, tenant: str, expect: int = 0, within_s: float = 30.0
) -> tuple[int, int]:
    """(the tenant's TPM on ``client``'s server once every ledger is settled, ledgers).

    ``expect``: how many requests the upstream served (its records).  A request admitted from
    a local allowance has no ledger until its settlement, which may still be on its way when
    the load stops (a settlement kept through the fault is retried with backoff), so the
    count waits for at least that many ledgers, every one settled, or ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        states = [client.hget(k, "state") for k in client.scan_iter(f"aiq:{{{tenant}}}:req:*")]
        done = sum(1 for s in states if s in (b"settled", b"reclaimed"))
        settled = done == len(states) and len(states) >= expect
        if settled or time.monotonic() > deadline:
            total = sum(
                int(client.get(k) or 0) for k in client.scan_iter(f"aiq:{{{tenant}}}:tpm:t:*")
            )
            return total, len(states)
        time.sleep(0.05)


def _p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


def measure(report: DrillReport, outs: list[Outcome], fault_at: float, promoted_at: float) -> None:
    """Fill ``report``'s request figures from ``outs``."""
    report.requests = len(outs)
    report.fault_to_promotion_s = promoted_at - fault_at
    for o in outs:
        bad = not (200 <= o.status < 300)
        if o.probe:
            report.probes += 1
            report.probes_failed += bad
        report.failed += bad
        report.cut_streams += o.cut
        if bad or o.cut:
            report.errors[f"{o.status}:{o.error}"] += 1
    # latency of non-streams only (a stream's length is its own)
    before = [(o.ended - o.started) * 1000 for o in outs if not o.stream and o.ended < fault_at]
    window = [
        (o.ended - o.started) * 1000
        for o in outs
        if not o.stream and fault_at - 1.0 <= o.started <= promoted_at + 1.0
    ]
    report.p99_before_ms = _p99(before)
    report.p99_window_ms = _p99(window)
    report.max_window_ms = max(window, default=0.0)


def replayed_of(stack: Stack) -> int:
    """Journal entries the processor replayed to a new master (its ``redis_failover_recovered``
    log lines)."""
    total = 0
    log = stack.proc("extproc0").log_path
    if log is None:
        return 0
    for line in log.read_bytes().splitlines():
        if b"redis_failover_recovered" in line:
            with contextlib.suppress(ValueError, KeyError):
                total += int(orjson.loads(line)["replayed"])
    return total


def _dump(workdir: Path, stack: Stack, port: int, outs: list[Outcome] | None = None) -> None:
    """Keep the ledgers, the simulator's records of the tenant and what its clients saw
    (``outs``) for a post-mortem."""
    recs = httpx.get(f"{stack.sim_url}/sim/requests", timeout=30).json()["requests"]
    with redis.Redis(port=port, decode_responses=True) as m:
        ledgers = {
            k: m.hgetall(k) for k in m.scan_iter(f"aiq:{{{TENANT}}}:req:*") if m.type(k) == "hash"
        }
    (workdir / "dump.json").write_bytes(
        orjson.dumps(
            {
                "records": [r for r in recs if r["tenant"] == TENANT],
                "ledgers": ledgers,
                "outcomes": [o for o in outs or () if not o.probe],
            }
        )
    )


def _under_load(
    stack: Stack,
    outs: list[Outcome],
    fault: Callable[[], Awaitable[tuple[float, float]]],
    *,
    clients: int,
    stream_share: float,
    fault_at_s: float,
    after_s: float,
) -> tuple[float, float]:
    """The drills' skeleton: the closed-loop load and its prober through ``stack`` (outcomes
    into ``outs``), ``fault()`` awaited ``fault_at_s`` in (it returns when the fault was made
    and when Redis took calls again, monotonic), the load stopped ``after_s`` after that;
    those two times."""

    async def run() -> tuple[float, float]:
        stop = asyncio.Event()
        load = asyncio.ensure_future(
            _load(
                stack.base_url,
                clients=clients,
                stream_share=stream_share,
                stop=stop,
                out=outs,
                probe_every_s=0.1,
                seed=7,
            )
        )
        await asyncio.sleep(fault_at_s)
        times = await fault()
        await asyncio.sleep(after_s)
        stop.set()
        await load
        return times

    return asyncio.run(run())


def _account(
    report: DrillReport,
    stack: Stack,
    outs: list[Outcome],
    times: tuple[float, float],
    primary: int,
) -> None:
    """What the clients saw around the fault (``times``: when it was made, when Redis took
    calls again), and the tenant's counter on ``primary`` (the port of the Redis serving its
    slot now) against the simulator's records."""
    measure(report, outs, *times)
    report.truth, records = truth_of(stack.sim_url, TENANT)
    waited = time.monotonic()
    with redis.Redis(port=primary) as m:
        report.notes["ledgers_at_end"] = sum(1 for _ in m.scan_iter(f"aiq:{{{TENANT}}}:req:*"))
        report.counter, ledgers = counter_of(m, TENANT, records)
    report.notes["settle_wait_s"] = round(time.monotonic() - waited, 2)
    report.notes["ledgers"] = ledgers
    report.notes["records"] = records
    report.notes["replayed"] = replayed_of(stack)


def sentinel_kill_drill(
    workdir: Path,
    *,
    clients: int = 12,
    stream_share: float = 0.7,
    fault_at_s: float = 6.0,
    after_s: float = 4.0,
    env: dict[str, str] | None = None,
    fault: str = "kill",
    strict: bool = False,
    extra: list[str] | None = None,
    lag_s: float = 0.3,
    during: Callable[[Stack, SentinelGroup, int], None] | None = None,
    lease_s: int | None = None,
    tpm: int | None = None,
) -> DrillReport:
    """The Sentinel drill: a master and two replicas, three sentinels (down-after 1 s); the
    master SIGKILLed (``fault="kill"``) or frozen until a replica is promoted
    (``fault="freeze"``: SIGSTOP, then SIGCONT) ``fault_at_s`` into the load.  With ``lag_s``
    the replicas' links are cut that long just before (DEBUG SLEEP): the master dies holding
    acknowledged writes no replica has, which only the processor's journal can give back.
    ``during(stack, group, old master's port)`` runs (in a thread) right after the fault, before
    the promotion is awaited; ``lease_s``: the reservation lease (a dead processor's requests
    are reclaimed that long after their last renewal).  Notes ``cut_wall`` and ``fault_wall``:
    when the links were cut and the fault made (unix seconds, the simulator's clock).
    ``tpm``: the busy tenant's daily token limit (with ``strict``, its streams strict), and
    :func:`limit_figures` in the notes."""
    rules = drill_rules(strict=strict) if tpm is None else drill_rules(strict=strict, tpm=tpm)
    if lease_s is not None:
        rules["failure"] = {"reservation_lease_seconds": lease_s}
    group = SentinelGroup(
        workdir / "sentinel",
        replicas=2,
        down_after_ms=1000,
        extra=[*(extra or []), "--enable-debug-command", "local"],
    )
    try:
        stack = start_stack(workdir / "stack", group.url(), rules, env)
    except BaseException:
        group.stop()
        raise
    report = DrillReport("sentinel", f"{fault}-strict" if strict else fault)
    try:
        outs: list[Outcome] = []

        async def make_fault() -> tuple[float, float]:
            old = group.master_port()
            report.notes["cut_wall"] = time.time()
            if lag_s > 0:
                for port in group.ports:
                    if port != old:
                        group.cut_replication(port, lag_s)
                await asyncio.sleep(lag_s * 0.8)
            fault_at = time.monotonic()
            report.notes["fault_wall"] = time.time()
            if fault == "kill":
                group.kill(old)
            else:
                group.procs[old].send_signal(signal.SIGSTOP)
            if during is not None:
                await asyncio.to_thread(during, stack, group, old)
            _, promoted = await asyncio.to_thread(group.wait_new_master, old, 30.0)
            if fault == "freeze":
                group.procs[old].send_signal(signal.SIGCONT)
            return fault_at, promoted

        times = _under_load(
            stack,
            outs,
            make_fault,
            clients=clients,
            stream_share=stream_share,
            fault_at_s=fault_at_s,
            after_s=after_s,
        )
        fault_at = times[0]
        new = group.master_port()
        _account(report, stack, outs, times, new)
        if tpm is not None:
            limit_figures(
                report, outs, stack.sim_url, tpm, fault_at, config=workdir / "stack" / "rules.yaml"
            )
        _dump(workdir, stack, new, outs)
    finally:
        with contextlib.suppress(Exception):
            stack.stop()
        group.stop()
    return report


def cluster_kill_drill(
    workdir: Path,
    *,
    clients: int = 12,
    stream_share: float = 0.7,
    fault_at_s: float = 6.0,
    after_s: float = 4.0,
    env: dict[str, str] | None = None,
    lag_s: float = 0.3,
    fault: str = "kill",
) -> DrillReport:
    """The Cluster drill: 3 primaries + 3 replicas (node timeout 2 s); the primary of the
    tenant's slot SIGKILLed ``fault_at_s`` into the load (its replica's link cut ``lag_s``
    just before, as in :func:`sentinel_kill_drill`).  ``fault="failover"``: a graceful
    failover instead, ``CLUSTER FAILOVER`` sent to that primary's replica (no link cut: the
    replica takes over once it has everything; the old primary becomes its replica)."""
    if fault not in ("kill", "failover"):
        raise ValueError(f"unknown fault {fault!r}")
    cluster = HaCluster(
        workdir / "cluster",
        primaries=3,
        node_timeout_ms=2000,
        extra=["--enable-debug-command", "local"],
    )
    try:
        stack = start_stack(workdir / "stack", cluster.url, drill_rules(), env)
    except BaseException:
        cluster.stop()
        raise
    report = DrillReport("cluster", fault)
    probe_key = f"aiq:{{{TENANT}}}:x"
    try:
        outs: list[Outcome] = []

        async def make_fault() -> tuple[float, float]:
            old = cluster.primary_of(probe_key)
            replica = cluster.replica_of(old)  # asked before its link is cut
            if fault == "kill" and lag_s > 0:
                cluster.cut_replication(replica, lag_s)
                await asyncio.sleep(lag_s * 0.8)
            fault_at = time.monotonic()
            if fault == "kill":
                cluster.kill(old)
            else:
                await asyncio.to_thread(cluster.failover, replica)
            _, promoted = await asyncio.to_thread(cluster.wait_new_primary, probe_key, old, 30.0)
            return fault_at, promoted

        times = _under_load(
            stack,
            outs,
            make_fault,
            clients=clients,
            stream_share=stream_share,
            fault_at_s=fault_at_s,
            after_s=after_s,
        )
        _account(report, stack, outs, times, cluster.primary_of(probe_key))
    finally:
        with contextlib.suppress(Exception):
            stack.stop()
        cluster.stop()
    return report


def _redis_argv(port: int, workdir: Path, fsync: str) -> list[str]:
    return [
        "redis-server",
        *("--port", str(port), "--bind", "127.0.0.1", "--save", ""),
        *("--appendonly", "yes", "--appendfsync", fsync, "--dir", str(workdir)),
    ]


def _wait_ping(port: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            with redis.Redis(port=port, socket_timeout=0.5) as r:
                if r.ping():
                    return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def restart_drill(
    workdir: Path,
    *,
    fsync: str = "everysec",
    down_s: float = 0.5,
    clients: int = 12,
    stream_share: float = 0.7,
    fault_at_s: float = 6.0,
    after_s: float = 4.0,
    env: dict[str, str] | None = None,
) -> DrillReport:
    """One Redis with ``appendonly yes`` (``appendfsync`` ``fsync``) SIGKILLed ``fault_at_s``
    into the load and started again from its AOF ``down_s`` later, on the same port and
    directory; the processor sees a new run id and replays its journal.  Its
    ``fault_to_promotion_s`` is the time until the restarted server answered."""
    rdir = workdir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = _redis_argv(port, rdir, fsync)
    log = rdir / "redis.log"
    proc = spawn(argv, log)
    procs = [proc]
    try:
        _wait_ping(port, 20.0)
        stack = start_stack(workdir / "stack", f"redis://127.0.0.1:{port}", drill_rules(), env)
    except BaseException:
        proc.kill()
        raise
    report = DrillReport("single-aof", f"restart-{fsync}")
    try:
        outs: list[Outcome] = []

        async def make_fault() -> tuple[float, float]:
            fault_at = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
            await asyncio.sleep(down_s)
            again = await asyncio.to_thread(spawn, argv, log)
            procs.append(again)
            await asyncio.to_thread(_wait_ping, port, 20.0)
            if again.poll() is not None:
                raise RuntimeError("the restarted redis-server exited (its port taken?)")
            return fault_at, time.monotonic()

        times = _under_load(
            stack,
            outs,
            make_fault,
            clients=clients,
            stream_share=stream_share,
            fault_at_s=fault_at_s,
            after_s=after_s,
        )
        _account(report, stack, outs, times, port)
        _dump(workdir, stack, port)
    finally:
        with contextlib.suppress(Exception):
            stack.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return report
