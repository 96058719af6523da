"""The serving-overhead benchmark's statistics (no timing is asserted)."""

from __future__ import annotations

from benchmarks.serving_overhead import percentile, summary


def test_summary_reports_medians_and_tails_in_milliseconds() -> None:
    ttft = [0.010, 0.002, 0.003, 0.004, 0.005]
    gaps = [0.001] * 9 + [0.009]
    out = summary(ttft, gaps)
    assert out["ttft_p50_ms"] == 4.0
    assert out["ttft_p90_ms"] == 10.0
    assert out["token_p50_ms"] == 1.0 and out["token_p90_ms"] == 9.0
    assert percentile([3.0], 0.99) == 3.0
