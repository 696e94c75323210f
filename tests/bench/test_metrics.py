"""Metric arithmetic on synthetic timings, checked against hand-computed values."""

from __future__ import annotations

import pytest

from tessera.bench.metrics import BenchmarkMetrics, LatencyStats, RequestResult, compute_metrics, format_report


def test_percentiles_use_linear_interpolation() -> None:
    s = LatencyStats.from_seconds([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s.count == 100
    assert s.mean == pytest.approx(50.5)
    assert s.median == pytest.approx(50.5)
    assert s.p90 == pytest.approx(90.1)
    assert s.p99 == pytest.approx(99.01)


def test_empty_samples_are_none_not_zero() -> None:
    assert LatencyStats.from_seconds([]) == LatencyStats(0, None, None, None, None)


def test_throughput_counts_successful_requests_only() -> None:
    results = [
        RequestResult(True, prompt_tokens=100, output_tokens=11, ttft=0.2, e2e_latency=1.2, itl=[0.1] * 10),
        RequestResult(True, prompt_tokens=50, output_tokens=21, ttft=0.4, e2e_latency=2.4, itl=[0.1] * 20),
        RequestResult(False, error="BadRequestError: nope", e2e_latency=0.1),
        RequestResult(False, error="BadRequestError: nope"),
    ]
    m = compute_metrics(results, duration_s=4.0)
    assert (m.num_completed, m.num_failed) == (2, 2)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.input_throughput == pytest.approx(150 / 4)
    assert m.output_throughput == pytest.approx(32 / 4)
    assert m.total_throughput == pytest.approx(182 / 4)
    assert m.ttft_ms.mean == pytest.approx(300.0)
    assert m.e2e_ms.median == pytest.approx(1800.0)
    # TPOT: (1.2 - 0.2) / 10 = 0.1 s and (2.4 - 0.4) / 20 = 0.1 s
    assert m.tpot_ms.median == pytest.approx(100.0)
    assert m.itl_ms.count == 30 and m.itl_ms.p99 == pytest.approx(100.0)
    assert m.errors == {"BadRequestError: nope": 2}
    assert "Failed requests:                  2" in format_report(m)


def test_tpot_needs_two_tokens_and_a_success() -> None:
    assert RequestResult(True, output_tokens=1, ttft=0.1, e2e_latency=0.1).tpot is None
    assert RequestResult(False, output_tokens=5).tpot is None
    assert RequestResult(True, output_tokens=3, ttft=1.0, e2e_latency=2.0).tpot == pytest.approx(0.5)


def test_round_trip_through_dict_and_bad_duration() -> None:
    m = compute_metrics([RequestResult(True, 3, 4, 0.1, 0.4, [0.1, 0.1, 0.1])], 1.0)
    assert BenchmarkMetrics.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], 0.0)
