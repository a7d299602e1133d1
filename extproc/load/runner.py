"""The I/O side of the harness: aiohttp clients, closed/open-loop scheduling, ground truth.

Everything that touches sockets lives here; parsing, statistics and reporting are in the
sans-IO modules (``sse``, ``windows``, ``report``, and ``extproc.stats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import structlog

from extproc.core.sse import SSEDecoder, SSEEventTooLarge
from extproc.load.config import LoadConfig
from extproc.load.progress import Counters, ProgressLine
from extproc.load.prompt import build_prompt, count_tokens
from extproc.load.records import (
    RATE_LIMIT_HEADERS,
    RequestRecord,
    join_ground_truth,
    sim_record_from_json,
)
from extproc.load.report import LoadReport, build_report
from extproc.load.sse import (
    MAX_EVENT_BYTES,
    StreamState,
    data_payloads,
    extract_content,
    extract_usage,
    parse_error,
)
from extproc.sim.records import SimRecord

log = structlog.get_logger(__name__)

GROUND_TRUTH_SETTLE_S = 3.0


@dataclass(frozen=True)
class RequestPlan:
    """What request ``n`` will be: tenant, model, streaming or not, size and target."""

    n: int
    tenant: str
    model: str
    stream: bool
    max_tokens: int
    target: str


class Planner:
    """Deterministic (seeded) choice of tenant, model, stream flag and max_tokens per request."""

    def __init__(self, config: LoadConfig) -> None:
        """Seed the generator from the config."""
        self.config = config
        self._rng = random.Random(config.seed)
        self._weights = list(config.key_weights) if config.key_weights else None

    def plan(self, n: int) -> RequestPlan:
        """The plan for request ``n`` (targets are used round-robin)."""
        c = self.config
        tenant = self._rng.choices(c.keys, weights=self._weights)[0]
        model = self._rng.choice(c.models)
        stream = self._rng.random() < c.stream_ratio
        lo, hi = c.max_tokens
        max_tokens = self._rng.randint(lo, hi)
        return RequestPlan(n, tenant, model, stream, max_tokens, c.targets[n % len(c.targets)])


def new_run_id() -> str:
    """A short unique run id used as the prefix of every ``x-client-request-id``."""
    return f"load-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


class Runner:
    """Holds the session, counters and records of one run."""

    def __init__(self, config: LoadConfig, run_id: str, session: aiohttp.ClientSession) -> None:
        """Prepare an empty run."""
        self.config = config
        self.run_id = run_id
        self.session = session
        self.planner = Planner(config)
        self.counters = Counters()
        self.records: list[RequestRecord] = []
        self.arrivals_delayed = 0
        self._next_n = 0
        self._start_mono = time.monotonic()
        duration = config.effective_duration
        self._deadline = None if duration is None else self._start_mono + duration

    def _may_start(self) -> bool:
        if self.config.requests is not None and self._next_n >= self.config.requests:
            return False
        return self._deadline is None or time.monotonic() < self._deadline

    def _take_n(self) -> int:
        n = self._next_n
        self._next_n += 1
        return n

    async def closed_loop(self) -> None:
        """``concurrency`` workers, each sending its next request when the previous ends."""

        async def worker() -> None:
            while self._may_start():
                await self.send(self.planner.plan(self._take_n()))

        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def open_loop(self) -> None:
        """Requests arrive at ``rate``/s (Poisson or uniform), at most ``max_in_flight`` open."""
        c = self.config
        assert c.rate is not None
        rng = random.Random(c.seed + 1)
        sem = asyncio.Semaphore(c.max_in_flight)
        tasks: set[asyncio.Task[None]] = set()
        next_at = time.monotonic()

        async def one(plan: RequestPlan) -> None:
            try:
                await self.send(plan)
            finally:
                sem.release()

        while self._may_start():
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self._may_start():
                break
            if sem.locked():
                self.arrivals_delayed += 1
            await sem.acquire()
            if not self._may_start():
                sem.release()
                break
            task = asyncio.create_task(one(self.planner.plan(self._take_n())))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            gap = rng.expovariate(c.rate) if c.arrival == "poisson" else 1.0 / c.rate
            next_at = max(next_at + gap, time.monotonic() - 1.0)
        if tasks:
            await asyncio.gather(*tasks)

    def _request_body(self, plan: RequestPlan, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": plan.model,
            "max_tokens": plan.max_tokens,
            "stream": plan.stream,
        }
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if plan.stream and self.config.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    async def send(self, plan: RequestPlan) -> None:
        """Send one request, record what happened and update the live counters."""
        c = self.config
        chat = c.endpoint == "chat"
        prompt, estimate = build_prompt(plan.n, c.prompt_tokens, chat)
        rec = RequestRecord(
            n=plan.n,
            request_id=f"{self.run_id}-{plan.n}",
            tenant=plan.tenant,
            model=plan.model,
            stream=plan.stream,
            target=plan.target,
            start_wall=time.time(),
            max_tokens=plan.max_tokens,
            prompt_tokens_estimate=estimate,
        )
        url = plan.target.rstrip("/") + ("/chat/completions" if chat else "/completions")
        headers = {
            "Authorization": f"Bearer {plan.tenant}",
            "Content-Type": "application/json",
            "x-client-request-id": rec.request_id,
            **dict(c.extra_headers),
        }
        payload = orjson.dumps(self._request_body(plan, prompt))
        self.counters.in_flight += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(c.request_timeout):
                async with self.session.post(
                    url, data=payload, headers=headers, allow_redirects=False
                ) as resp:
                    await self._handle_response(resp, rec, t0)
        except TimeoutError:
            rec.outcome, rec.reason = "failed", "timeout"
        except aiohttp.ClientError as exc:
            rec.outcome, rec.reason = "failed", f"connection_error:{type(exc).__name__}"
        except OSError as exc:
            rec.outcome, rec.reason = "failed", f"os_error:{type(exc).__name__}"
        except SSEEventTooLarge as exc:
            rec.outcome, rec.reason = "failed", f"sse_event_too_large:{exc.size}"
        finally:
            rec.duration = time.monotonic() - t0
            self.counters.in_flight -= 1
            self.counters.done += 1
            if rec.outcome == "refused":
                self.counters.refused += 1
            elif rec.outcome == "cut":
                self.counters.cut += 1
            elif rec.outcome == "failed":
                self.counters.failed += 1
            self.records.append(rec)

    async def _handle_response(
        self, resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float
    ) -> None:
        rec.status = resp.status
        rec.headers = {h: resp.headers[h] for h in RATE_LIMIT_HEADERS if h in resp.headers}
        if resp.status == 429 or not 200 <= resp.status < 300:
            raw = await resp.read()
            err = None
            with contextlib.suppress(orjson.JSONDecodeError):
                err = parse_error(orjson.loads(raw))
            if err is not None:
                rec.error_code, rec.error_type = err.code, err.type
            if resp.status == 429:
                rec.outcome, rec.reason = "refused", None
            else:
                rec.outcome, rec.reason = "failed", f"http_{resp.status}"
            return
        if rec.stream:
            await self._read_stream(resp, rec, t0)
        else:
            await self._read_body(resp, rec, t0)

    def _add_delta(self, rec: RequestRecord, text: str, at: float) -> None:
        tokens = count_tokens(text)
        if not rec.delta_offsets:
            rec.ttft = at
        rec.delta_offsets.append(at)
        rec.delta_tokens.append(tokens)
        self.counters.output_tokens += tokens

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float
    ) -> None:
        decoder = SSEDecoder(max_event_bytes=MAX_EVENT_BYTES)
        state = StreamState()
        async for chunk in resp.content.iter_any():
            at = time.monotonic() - t0
            for payload in data_payloads(decoder.feed(chunk)):
                text = state.on_event(payload)
                if text:
                    self._add_delta(rec, text, at)
            if state.done or state.error is not None:
                break  # after a cut's error event the gateway aborts the response
        if not state.done:
            for payload in data_payloads(decoder.flush()):
                text = state.on_event(payload)
                if text:
                    self._add_delta(rec, text, time.monotonic() - t0)
        rec.saw_done = state.done
        rec.usage_prompt_tokens = state.prompt_tokens
        rec.usage_completion_tokens = state.completion_tokens
        if state.error is not None:
            rec.error_code, rec.error_type = state.error.code, state.error.type
        rec.outcome, rec.reason = state.outcome()

    async def _read_body(self, resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float) -> None:
        raw = await resp.read()
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            rec.outcome, rec.reason = "failed", "invalid_json"
            return
        err = parse_error(obj)
        if err is not None:
            rec.error_code, rec.error_type = err.code, err.type
            rec.outcome, rec.reason = (
                ("cut", None)
                if err.is_quota_cut
                else ("failed", f"body_error:{err.code or err.type or 'unknown'}")
            )
            return
        text = extract_content(obj)
        if text:
            self._add_delta(rec, text, time.monotonic() - t0)
        rec.usage_prompt_tokens, rec.usage_completion_tokens = extract_usage(obj)
        if isinstance(obj, dict) and isinstance(obj.get("choices"), list):
            rec.outcome, rec.reason = "ok", None
        else:
            rec.outcome, rec.reason = "failed", "no_choices"


async def fetch_ground_truth(
    session: aiohttp.ClientSession,
    sim_url: str,
    run_id: str,
    settle_s: float = GROUND_TRUTH_SETTLE_S,
) -> list[SimRecord]:
    """Records of this run from ``GET {sim_url}/sim/requests``, waiting briefly for stragglers."""
    deadline = time.monotonic() + settle_s
    prefix = f"{run_id}-"
    while True:
        async with session.get(
            sim_url.rstrip("/") + "/sim/requests", allow_redirects=False
        ) as resp:
            resp.raise_for_status()
            body = orjson.loads(await resp.read())
        raw = body.get("requests", []) if isinstance(body, dict) else []
        recs = [
            s
            for s in (sim_record_from_json(r) for r in raw if isinstance(r, dict))
            if s is not None and (s.client_request_id or "").startswith(prefix)
        ]
        if all(s.ending != "in_progress" for s in recs) or time.monotonic() >= deadline:
            return recs
        await asyncio.sleep(0.2)


async def _progress_loop(line: ProgressLine) -> None:
    while True:
        line.render()
        await asyncio.sleep(0.25)


async def run_load(config: LoadConfig) -> LoadReport:
    """Run the load described by ``config`` and return the report (nothing is written)."""
    config = config.validated()
    run_id = config.run_id or new_run_id()
    log.info(
        "load_run_start",
        run_id=run_id,
        targets=list(config.targets),
        mode="open" if config.open_loop else "closed",
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.request_timeout)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trust_env=False
    ) as session:
        runner = Runner(config, run_id, session)
        progress = ProgressLine(runner.counters) if config.progress else None
        progress_task = (
            asyncio.create_task(_progress_loop(progress)) if progress is not None else None
        )
        started_at = time.time()
        try:
            if config.open_loop:
                await runner.open_loop()
            else:
                await runner.closed_loop()
        finally:
            ended_at = time.time()
            if progress_task is not None:
                progress_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await progress_task
            if progress is not None:
                progress.close()
        ground_truth: dict[str, Any] | None = None
        if config.sim_url:
            try:
                sim = await fetch_ground_truth(session, config.sim_url, run_id)
                ground_truth = {"available": True, **join_ground_truth(runner.records, sim)}
            except (aiohttp.ClientError, OSError, orjson.JSONDecodeError, TimeoutError) as exc:
                log.warning("ground_truth_unavailable", sim_url=config.sim_url, error=str(exc))
                ground_truth = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    records = sorted(runner.records, key=lambda r: r.n)
    report = build_report(
        records,
        config,
        started_at=started_at,
        ended_at=ended_at,
        run_id=run_id,
        ground_truth=ground_truth,
        run_stats={"requests_sent": len(records), "arrivals_delayed": runner.arrivals_delayed},
    )
    log.info(
        "load_run_end",
        run_id=run_id,
        total=report.totals["total"],
        refused=report.totals["refused"],
        cut=report.totals["cut"],
        failed=report.totals["failed"],
    )
    return report
