"""The engine-metrics reader the engine tests and bench take their ground truth from."""

from __future__ import annotations

import pytest

from extproc.bench.vllm import EngineError, EngineMetrics, parse_metrics, split_cpus

pytestmark = pytest.mark.unit

SAMPLE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 54.0
vllm:prompt_tokens_total{engine="1",model_name="tiny"} 27.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7648e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 500.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0
"""


def test_parse_sums_label_sets_and_keeps_gauges() -> None:
    """Counters are summed over engines; gauges and finish reasons are read; zeros dropped."""
    m = parse_metrics(SAMPLE)
    assert m == EngineMetrics(
        prompt_tokens=81,
        generation_tokens=500,
        running=2,
        waiting=1,
        finished={"stop": 1, "length": 2},
    )
    assert m.tokens == 581


def test_difference_of_two_scrapes() -> None:
    """A delta keeps the later gauges and only the finish reasons that moved."""
    a = EngineMetrics(10, 100, 0, 0, {"length": 1, "stop": 2})
    b = EngineMetrics(37, 160, 1, 0, {"length": 2, "stop": 2, "abort": 1})
    assert b - a == EngineMetrics(27, 60, 1, 0, {"abort": 1, "length": 1})


def test_missing_counters_are_an_error() -> None:
    """A /metrics page without the token counters (not a vLLM) is refused by name."""
    with pytest.raises(EngineError, match="vllm:generation_tokens_total"):
        parse_metrics(SAMPLE.split("# HELP vllm:generation_tokens_total", maxsplit=1)[0])


def test_cpu_split_keeps_the_engine_apart() -> None:
    """The engine gets one CPU and the gateway the others (both the one CPU on a single core)."""
    engine, gateway = split_cpus()
    assert len(engine) == 1
    assert gateway and (engine.isdisjoint(gateway) or engine == gateway)
