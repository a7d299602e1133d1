"""Integration: smoke runs of the load harness against an in-test aiohttp fake upstream.

The fake upstream decides deterministically from the request number in
``x-client-request-id``: some requests are refused with 429 + rate-limit headers, some
streams are cut with the in-band quota error event, some streams end without ``[DONE]``.
It also serves ``/sim/requests`` so the ground-truth join is exercised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from extproc.load import LoadConfig, run_load, validate_report
from extproc.load.cli import main as cli_main
from extproc.load.output import write_report

pytestmark = pytest.mark.integration

CUT_EVENT = {
    "error": {"message": "token quota exhausted", "type": "tokens", "code": "tpm_limit_exceeded"}
}


def behaviour(n: int, stream: bool) -> str:
    """What the fake does with request ``n``: refuse, cut, truncate or answer."""
    if n % 5 == 0:
        return "refuse"
    if stream and n % 5 == 1:
        return "cut"
    if stream and n % 7 == 3:
        return "truncate"
    return "ok"


@dataclass
class Fake:
    """Fake upstream state: ground-truth records by request id."""

    sim: dict[str, dict[str, Any]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)


FAKE_KEY: web.AppKey[Fake] = web.AppKey("fake", Fake)


async def _chat(request: web.Request) -> web.StreamResponse:
    fake: Fake = request.app[FAKE_KEY]
    rid = request.headers.get("x-client-request-id", "")
    fake.seen.append(rid)
    assert request.headers["Authorization"].startswith("Bearer ")
    body = orjson.loads(await request.read())
    n = int(rid.rsplit("-", 1)[1])
    stream = bool(body.get("stream"))
    what = behaviour(n, stream)
    rec: dict[str, Any] = {
        "client_request_id": rid,
        "tokens_sent": 0,
        "ending": "completed",
        "started_at": time.time(),
        "first_token_at": None,
        "last_token_at": None,
        "ended_at": None,
        "disconnected_at": None,
        "tenant": None,
    }
    if what == "refuse":
        code = "rpm_limit_exceeded" if n % 10 == 0 else "tpm_limit_exceeded"
        return web.json_response(
            {"error": {"message": "slow down", "type": "requests", "code": code}},
            status=429,
            headers={
                "retry-after": "2",
                "x-ratelimit-limit-requests": "60",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "2s",
                "x-ratelimit-limit-tokens": "1000",
                "x-ratelimit-remaining-tokens": "0",
                "x-ratelimit-reset-tokens": "2s",
            },
        )
    fake.sim[rid] = rec
    words = int(body.get("max_tokens", 8))
    if not stream:
        rec.update(
            tokens_sent=words,
            first_token_at=time.time(),
            last_token_at=time.time(),
            ended_at=time.time(),
        )
        return web.json_response(
            {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": " hello" * words}}
                ],
                "usage": {"prompt_tokens": 20, "completion_tokens": words},
            },
            headers={"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "500"},
        )
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    limit = 3 if what in ("cut", "truncate") else words
    for _ in range(limit):
        chunk = {"choices": [{"index": 0, "delta": {"content": " hello"}}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        now = time.time()
        rec["first_token_at"] = rec["first_token_at"] or now
        rec["last_token_at"] = now
        rec["tokens_sent"] += 1
        await asyncio.sleep(0.002)
    if what == "cut":
        await resp.write(b"data: " + orjson.dumps(CUT_EVENT) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    elif what == "ok":
        usage = {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": words}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    rec["ended_at"] = time.time()
    await resp.write_eof()
    return resp


async def _sim_requests(request: web.Request) -> web.Response:
    fake: Fake = request.app[FAKE_KEY]
    return web.json_response({"requests": list(fake.sim.values())})


@pytest.fixture
async def fake_upstream() -> AsyncIterator[tuple[str, Fake]]:
    """Start the fake upstream on a free loopback port; yield its base URL and state."""
    fake = Fake()
    app = web.Application()
    app[FAKE_KEY] = fake
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _chat)
    app.router.add_get("/sim/requests", _sim_requests)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        await runner.cleanup()


def _expected(n_total: int, stream_of: dict[int, bool]) -> dict[str, int]:
    exp = {"refuse": 0, "cut": 0, "truncate": 0, "ok": 0}
    for n in range(n_total):
        exp[behaviour(n, stream_of[n])] += 1
    return exp


async def test_closed_loop_counts_refusals_and_cuts(
    fake_upstream: tuple[str, Fake], tmp_path: Path
) -> None:
    """A closed-loop run classifies 429s, cut streams and truncated streams exactly."""
    base, fake = fake_upstream
    cfg = LoadConfig(
        targets=(f"{base}/v1",),
        keys=("sk-a", "sk-b"),
        key_weights=(2.0, 1.0),
        models=("m1", "m2"),
        stream_ratio=0.7,
        max_tokens=(4, 12),
        prompt_tokens=30,
        concurrency=6,
        requests=60,
        duration=60.0,
        request_timeout=10.0,
        window_seconds=5.0,
        limits_tpm=(("sk-a", 600),),
        sim_url=base,
        run_id="t1",
    )
    report = await run_load(cfg)
    assert validate_report(report) == []
    t = report.totals
    assert t["total"] == 60
    stream_of = {r.n: r.stream for r in report.records}
    exp = _expected(60, stream_of)
    assert t["refused"] == exp["refuse"]
    assert t["cut"] == exp["cut"]
    assert t["failed"] == exp["truncate"]
    assert t["failed_by_reason"] == (
        {"stream_ended_without_done": exp["truncate"]} if exp["truncate"] else {}
    )
    assert t["ok"] == exp["ok"]
    assert sum(t["refused_by_code"].values()) == t["refused"]
    assert set(t["refused_by_code"]) <= {"rpm_limit_exceeded", "tpm_limit_exceeded"}
    assert sorted(fake.seen) == sorted(f"t1-{n}" for n in range(60))
    gt = report.data["ground_truth"]
    assert gt["available"] is True
    assert gt["matched"] == 60 - exp["refuse"]
    # the client saw every token the fake wrote (one cl100k token per " hello")
    assert t["output_tokens_upstream"] == t["output_tokens_client"]
    for r in report.records:
        if r.outcome == "refused":
            assert r.headers["retry-after"] == "2"
            assert r.headers["x-ratelimit-limit-tokens"] == "1000"
        if r.outcome == "cut":
            assert r.error_code == "tpm_limit_exceeded"
            assert r.output_tokens_client == 3
    assert report.data["overshoot"]["tenants"]["sk-a"]["limit_per_window"] == 50.0
    paths = write_report(report, tmp_path)
    assert {p.name for p in paths} == {"report.json", "requests.jsonl", "report.png"}
    assert validate_report(orjson.loads((tmp_path / "report.json").read_bytes())) == []
    assert (tmp_path / "report.png").stat().st_size > 0


async def test_open_loop_uniform_stops_by_itself(fake_upstream: tuple[str, Fake]) -> None:
    """An open-loop run with a request bound stops and yields a consistent report."""
    base, _ = fake_upstream
    cfg = LoadConfig(
        targets=(f"{base}/v1", f"{base}/v1/"),
        keys=("sk-a",),
        rate=200.0,
        arrival="uniform",
        max_in_flight=4,
        requests=25,
        max_tokens=(5, 5),
        stream_ratio=1.0,
        endpoint="completions",
        request_timeout=10.0,
    )
    report = await run_load(cfg)
    assert validate_report(report) == []
    assert report.totals["total"] == 25
    assert report.data["run"]["mode"] == "open"
    assert {r.target for r in report.records} == {f"{base}/v1", f"{base}/v1/"}


async def test_unreachable_target_counts_failures() -> None:
    """Connection errors are failures, the run still ends and the report is consistent."""
    cfg = LoadConfig(
        targets=("http://127.0.0.1:9/v1",),
        keys=("sk-a",),
        requests=5,
        concurrency=2,
        request_timeout=5.0,
        sim_url="http://127.0.0.1:9",
    )
    report = await run_load(cfg)
    assert validate_report(report) == []
    assert report.totals["failed"] == 5
    assert report.data["ground_truth"]["available"] is False


async def test_cli_writes_report_and_flags_overshoot(
    fake_upstream: tuple[str, Fake], tmp_path: Path
) -> None:
    """The CLI entry point writes the report and exits 1 only with --fail-on-overshoot."""
    base, _ = fake_upstream

    def argv(extra: list[str], out: Path) -> list[str]:
        return [
            "--target",
            f"{base}/v1",
            "--key",
            "sk-a",
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--max-tokens",
            "6",
            "--no-progress",
            "--no-plot",
            "--request-timeout",
            "10",
            "--limit-tpm",
            "sk-a=1",
            "--out",
            str(out),
            *extra,
        ]

    # the CLI runs its own event loop, so it goes to a thread while the fake keeps serving
    assert await asyncio.to_thread(cli_main, argv([], tmp_path / "a")) == 0
    assert await asyncio.to_thread(cli_main, argv(["--fail-on-overshoot"], tmp_path / "b")) == 1
    assert (
        await asyncio.to_thread(
            cli_main,
            argv(["--fail-on-overshoot", "--overshoot-tolerance", "100000%"], tmp_path / "c"),
        )
        == 0
    )
    assert (tmp_path / "a" / "report.json").exists()
    assert not (tmp_path / "a" / "report.png").exists()
    assert await asyncio.to_thread(cli_main, ["--target", "http://10.1.2.3/v1"]) == 2
