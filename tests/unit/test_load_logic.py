"""Unit tests of the load harness's pure logic: SSE parsing, statistics, windows, validation."""

from __future__ import annotations

import copy

import orjson
import pytest

from extproc.core.sse import SSEDecoder
from extproc.load.config import (
    LoadConfig,
    LoadConfigError,
    is_loopback_url,
    parse_limit,
    parse_max_tokens,
    parse_weights,
)
from extproc.load.progress import Counters, format_line
from extproc.load.prompt import build_prompt, count_tokens
from extproc.load.records import RequestRecord, join_ground_truth, sim_record_from_json
from extproc.load.report import LoadReport, build_report
from extproc.load.sse import classify_stream, data_payloads, parse_error
from extproc.load.summary import summary_text
from extproc.load.tolerance import overshoot_violations
from extproc.load.validate import validate_report
from extproc.load.windows import (
    output_token_events,
    prompt_tokens_charged,
    spread_uniform,
    tenant_windows,
    window_start,
)
from extproc.stats import percentile, summarize

pytestmark = pytest.mark.unit


def _chunk(text: str) -> str:
    return orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).decode()


CUT_EVENT = orjson.dumps(
    {"error": {"message": "quota", "type": "tokens", "code": "tpm_limit_exceeded"}}
).decode()


def _rec(n: int = 0, tenant: str = "sk-a", **kw: object) -> RequestRecord:
    base: dict[str, object] = {
        "n": n,
        "request_id": f"run-{n}",
        "tenant": tenant,
        "model": "m",
        "stream": True,
        "target": "http://127.0.0.1:1/v1",
        "start_wall": 1200.0,
        "max_tokens": 10,
        "prompt_tokens_estimate": 5,
        "status": 200,
        "outcome": "ok",
        "duration": 1.0,
    }
    base.update(kw)
    return RequestRecord(**base)  # type: ignore[arg-type]


# --- SSE -----------------------------------------------------------------------------------


def test_sse_parser_splits_events_across_chunks() -> None:
    """Events split over arbitrary chunk boundaries and CRLF line ends are reassembled."""
    raw = f"data: {_chunk('a')}\r\n\r\ndata: {_chunk('b')}\n\n: comment\n\ndata: [DONE]\n\n"
    decoder = SSEDecoder()
    out: list[str] = []
    data = raw.encode()
    for i in range(0, len(data), 7):
        out.extend(data_payloads(decoder.feed(data[i : i + 7])))
    out.extend(data_payloads(decoder.flush()))
    assert out == [_chunk("a"), _chunk("b"), "[DONE]"]


def test_sse_multiline_data_joined() -> None:
    """Several data: lines of one event are joined with newlines."""
    assert data_payloads(SSEDecoder().feed(b"data: x\ndata:y\nevent: e\n\n")) == ["x\ny"]


def test_classify_normal_end() -> None:
    """A stream ending with [DONE] and no error is ok."""
    assert classify_stream([_chunk("hi"), _chunk(" there"), "[DONE]"]) == ("ok", None)


def test_classify_cut_stream() -> None:
    """An in-band tpm_limit_exceeded error event followed by [DONE] is a cut."""
    assert classify_stream([_chunk("hi"), CUT_EVENT, "[DONE]"]) == ("cut", None)


def test_classify_cut_by_type_without_done() -> None:
    """An error event of type requests counts as a cut even if [DONE] never came."""
    ev = orjson.dumps({"error": {"message": "m", "type": "requests", "code": "x"}}).decode()
    assert classify_stream([_chunk("a"), ev])[0] == "cut"


def test_classify_truncated_stream_fails() -> None:
    """A stream that ends without [DONE] (and no error) is failed."""
    assert classify_stream([_chunk("a")]) == ("failed", "stream_ended_without_done")


def test_classify_other_error_fails() -> None:
    """An in-band error unrelated to quotas is a failure, not a cut."""
    ev = orjson.dumps({"error": {"message": "boom", "type": "server_error", "code": "oops"}})
    assert classify_stream([ev.decode(), "[DONE]"]) == ("failed", "stream_error:oops")


def test_parse_error_shapes() -> None:
    """Error objects and bare error strings are recognised; others are not."""
    e = parse_error({"error": {"message": "m", "type": "tokens", "code": "tpm_limit_exceeded"}})
    assert e is not None and e.is_quota_cut
    assert parse_error({"error": "plain"}) is not None
    assert parse_error({"choices": []}) is None
    assert parse_error([1, 2]) is None


# --- statistics ----------------------------------------------------------------------------


def test_percentile_linear_interpolation() -> None:
    """Percentiles interpolate linearly between order statistics."""
    vals = [1.0, 2.0, 3.0, 4.0]
    assert percentile(vals, 0) == 1.0
    assert percentile(vals, 100) == 4.0
    assert percentile(vals, 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(vals, 101)


def test_summarize_scales_and_orders() -> None:
    """summarize applies the scale and reports ordered percentiles."""
    s = summarize([0.001 * i for i in range(1, 101)], 1000.0)
    assert s["count"] == 100
    assert s["min"] == 1.0 and s["max"] == 100.0
    assert s["p50"] <= s["p90"] <= s["p99"]
    assert summarize([])["p50"] is None


# --- windows and overshoot -----------------------------------------------------------------


def test_window_start_aligned_to_wall_clock() -> None:
    """Windows start at multiples of the window length."""
    assert window_start(125.0, 60) == 120.0
    assert window_start(120.0, 60) == 120.0
    assert window_start(119.999, 60) == 60.0
    with pytest.raises(ValueError):
        window_start(1.0, 0)


def test_tokens_assigned_to_delta_windows_and_overshoot() -> None:
    """Client deltas land in their own windows; overshoot is max(0, tokens - limit)."""
    # start 1190 (window 1140), deltas at 1195 (window 1140) and 1205, 1210 (window 1200)
    rec = _rec(
        start_wall=1190.0,
        delta_offsets=[5.0, 15.0, 20.0],
        delta_tokens=[10, 20, 30],
        usage_prompt_tokens=7,
    )
    rows = tenant_windows([rec], 60.0, {"sk-a": 40})
    r = rows["sk-a"]
    assert [w.start for w in r] == [1140.0, 1200.0]
    assert r[0].output_tokens == 10 and r[0].prompt_tokens == 7
    assert r[1].output_tokens == 50 and r[1].prompt_tokens == 0
    assert r[0].overshoot == 0.0 and r[1].overshoot == 10.0
    assert r[1].utilisation == pytest.approx(50 / 40)


def test_limit_scaled_to_window_length() -> None:
    """A TPM limit is scaled to the window length (N * window / 60)."""
    rows = tenant_windows([_rec(delta_offsets=[0.0], delta_tokens=[1])], 30.0, {"sk-a": 600})
    assert rows["sk-a"][0].limit == 300.0


def test_window_gaps_filled_with_zero_rows() -> None:
    """Windows without tokens between active ones appear with zero tokens."""
    a = _rec(0, start_wall=0.0, delta_offsets=[1.0], delta_tokens=[3])
    b = _rec(1, start_wall=180.0, delta_offsets=[1.0], delta_tokens=[4])
    rows = tenant_windows([a, b], 60.0)["sk-a"]
    assert [w.start for w in rows] == [0.0, 60.0, 120.0, 180.0]
    assert [w.output_tokens for w in rows] == [3, 0, 0, 4]
    assert rows[0].overshoot is None and rows[0].utilisation is None


def test_prompt_tokens_only_for_2xx() -> None:
    """Refused or failed-before-response requests charge no prompt tokens."""
    assert prompt_tokens_charged(_rec(status=429, outcome="refused")) == 0
    assert prompt_tokens_charged(_rec(status=None, outcome="failed")) == 0
    assert prompt_tokens_charged(_rec(usage_prompt_tokens=11)) == 11
    assert prompt_tokens_charged(_rec()) == 5


def test_ground_truth_surplus_spread_over_upstream_interval() -> None:
    """Tokens the upstream sent beyond the client count are spread after the last delta."""
    rec = _rec(
        start_wall=100.0,
        delta_offsets=[1.0],
        delta_tokens=[10],
        upstream_tokens=30,
        upstream_first_token_at=101.0,
        upstream_last_token_at=111.0,
    )
    ev = output_token_events(rec)
    assert sum(n for _, n in ev) == pytest.approx(30)
    assert all(101.0 <= t <= 111.0 for t, _ in ev)


def test_ground_truth_smaller_scales_client_deltas() -> None:
    """When the upstream reports fewer tokens, client deltas are scaled down to it."""
    rec = _rec(delta_offsets=[1.0, 2.0], delta_tokens=[10, 10], upstream_tokens=10)
    ev = output_token_events(rec)
    assert [n for _, n in ev] == [5.0, 5.0]


def test_ground_truth_without_client_deltas() -> None:
    """Upstream tokens without client deltas or timing go to the request's end."""
    rec = _rec(start_wall=100.0, duration=2.0, upstream_tokens=8)
    assert output_token_events(rec) == [(102.0, 8.0)]
    assert spread_uniform(0, 1.0, 2.0) == []


# --- report and validation -----------------------------------------------------------------


def _records() -> list[RequestRecord]:
    return [
        _rec(0, "sk-a", delta_offsets=[0.1, 0.2], delta_tokens=[3, 4], ttft=0.1, saw_done=True),
        _rec(
            1,
            "sk-a",
            outcome="cut",
            delta_offsets=[0.1],
            delta_tokens=[2],
            ttft=0.1,
            error_code="tpm_limit_exceeded",
            error_type="tokens",
        ),
        _rec(
            2,
            "sk-b",
            status=429,
            outcome="refused",
            error_code="rpm_limit_exceeded",
            headers={"retry-after": "3", "x-ratelimit-limit-requests": "10"},
        ),
        _rec(3, "sk-b", status=None, outcome="failed", reason="timeout"),
        _rec(
            4,
            "sk-b",
            model="m2",
            stream=False,
            delta_offsets=[0.5],
            delta_tokens=[9],
            usage_prompt_tokens=12,
            usage_completion_tokens=9,
        ),
    ]


def _report() -> dict[str, object]:
    cfg = LoadConfig(keys=("sk-a", "sk-b"), models=("m", "m2"), limits_tpm=(("sk-a", 5),))
    rep = build_report(_records(), cfg, started_at=1200.0, ended_at=1210.0, run_id="run")
    return rep.data


def test_report_counts_and_consistency() -> None:
    """A built report has the expected counts and validates cleanly."""
    data = _report()
    assert validate_report(data) == []
    t = data["totals"]
    assert isinstance(t, dict)
    assert (t["total"], t["ok"], t["cut"], t["refused"], t["failed"], t["admitted"]) == (
        5,
        2,
        1,
        1,
        1,
        3,
    )
    assert t["refused_by_code"] == {"rpm_limit_exceeded": 1}
    assert t["output_tokens_client"] == 18
    ov = data["overshoot"]
    assert isinstance(ov, dict)
    # sk-a: 9 output + 10 prompt (2 x estimate 5) in one window, limit 5 -> overshoot 14
    assert ov["tenants"]["sk-a"]["max_overshoot"] == 14.0
    assert ov["max_overshoot"] == 14.0
    assert overshoot_violations(data, "0") and not overshoot_violations(data, "300%")
    assert "sk-a" in summary_text(data)
    orjson.dumps(data)


def test_a_built_report_checks_and_prints_itself() -> None:
    """LoadReport's own problems() and summary_text() are the module functions over its data,
    and validate_report takes the report object as well as its dict."""
    cfg = LoadConfig(keys=("sk-a", "sk-b"), models=("m", "m2"), limits_tpm=(("sk-a", 5),))
    rep = build_report(_records(), cfg, started_at=1200.0, ended_at=1210.0, run_id="run")
    assert rep.problems() == validate_report(rep) == validate_report(rep.data) == []
    assert rep.summary_text() == summary_text(rep.data)
    broken = LoadReport(data={**rep.data, "totals": {}}, records=rep.records)
    assert broken.problems() == validate_report(broken.data) != []


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("totals", "failed"), 5, "admitted + refused + failed"),
        (("totals", "cut"), 9, "ok + cut"),
        (("tenants", "sk-a", "ok"), 7, "tenants"),
        (("tenants", "sk-b", "refused_by_code"), {"x": 1}, "refused_by_code"),
        (("models", "m2", "total"), 3, "models"),
        (("overshoot", "max_overshoot"), 1.0, "overshoot.max_overshoot"),
    ],
)
def test_validator_catches_inconsistencies(
    path: tuple[str, ...], value: object, needle: str
) -> None:
    """Tampering with any count makes validate_report report a problem."""
    data = copy.deepcopy(_report())
    node: object = data
    for key in path[:-1]:
        assert isinstance(node, dict)
        node = node[key]
    assert isinstance(node, dict)
    node[path[-1]] = value
    problems = validate_report(data)
    assert problems, path
    assert any(needle in p for p in problems), problems


def test_validator_catches_window_mismatch_and_missing_sections() -> None:
    """Window sums that disagree with delivered tokens and missing sections are reported."""
    data = copy.deepcopy(_report())
    windows = data["windows"]
    assert isinstance(windows, dict)
    windows["tenants"]["sk-a"][0]["output_tokens"] += 100
    assert any("windows.sk-a" in p for p in validate_report(data))
    assert validate_report({"totals": {}}) != []


def test_join_ground_truth_by_request_id() -> None:
    """Simulator records attach to client records by x-client-request-id."""
    recs = _records()
    sims = [
        sim_record_from_json(
            {
                "client_request_id": "run-0",
                "tokens_sent": 7,
                "ending": "completed",
                "first_token_at": 1.0,
            }
        ),
        sim_record_from_json(
            {"client_request_id": "other-1", "tokens_sent": 1, "ending": "completed"}
        ),
        sim_record_from_json({"tokens_sent": 1}),
    ]
    stats = join_ground_truth(recs, [s for s in sims if s is not None])
    assert stats["matched"] == 1 and stats["upstream_without_client"] == 1
    assert recs[0].upstream_tokens == 7 and recs[0].upstream_ending == "completed"


# --- config and helpers --------------------------------------------------------------------


def test_only_loopback_targets_allowed() -> None:
    """Non-loopback URLs are rejected, loopback ones accepted."""
    assert is_loopback_url("http://127.0.0.1:10000/v1")
    assert is_loopback_url("http://localhost:1/v1")
    assert is_loopback_url("http://[::1]:8080")
    assert not is_loopback_url("http://10.0.0.1/v1")
    assert not is_loopback_url("http://example.com/v1")
    assert not is_loopback_url("ftp://127.0.0.1/")
    with pytest.raises(LoadConfigError):
        LoadConfig(targets=("http://192.168.1.1/v1",)).validated()
    with pytest.raises(LoadConfigError):
        LoadConfig(sim_url="http://8.8.8.8").validated()


def test_config_validation() -> None:
    """Invalid configurations raise LoadConfigError; defaults are valid and bounded."""
    cfg = LoadConfig().validated()
    assert cfg.effective_duration is not None
    with pytest.raises(LoadConfigError):
        LoadConfig(keys=("a",), key_weights=(1.0, 2.0)).validated()
    with pytest.raises(LoadConfigError):
        LoadConfig(limits_tpm=(("nope", 1),)).validated()
    with pytest.raises(LoadConfigError):
        LoadConfig(stream_ratio=1.5).validated()


def test_cli_value_parsers() -> None:
    """--max-tokens, --limit-tpm and --key-weights spellings parse or raise."""
    assert parse_max_tokens("100:1000") == (100, 1000)
    assert parse_max_tokens("5") == (5, 5)
    assert parse_limit("sk-a=1000") == ("sk-a", 1000)
    assert parse_weights("3,1") == (3.0, 1.0)
    for bad in ("0", "9:3", "x"):
        with pytest.raises(LoadConfigError):
            parse_max_tokens(bad)
    with pytest.raises(LoadConfigError):
        parse_limit("sk-a")
    with pytest.raises(LoadConfigError):
        parse_weights("0,0")


def test_prompt_is_deterministic_and_sized() -> None:
    """Prompts are deterministic and close to the requested token count."""
    a, est = build_prompt(3, 200, chat=True)
    b, _ = build_prompt(3, 200, chat=True)
    assert a == b
    assert 195 <= count_tokens(a) <= 210
    assert est > count_tokens(a)


def test_progress_line_format() -> None:
    """The progress line shows the live counters."""
    c = Counters(
        started_mono=0.0, done=5, in_flight=2, refused=1, cut=1, failed=0, output_tokens=100
    )
    line = format_line(c, now=10.0)
    assert "done 5" in line and "429 1" in line and "10 tok/s" in line
