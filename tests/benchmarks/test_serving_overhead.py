"""The serving-overhead benchmark: its statistics, and its gRPC and HTTP clients against a local
cluster with the HTTP API (small counts; no timing is asserted)."""

from __future__ import annotations

import httpx2

from benchmarks.serving_overhead import Timings, alternating, percentile, prompts, summary
from cluster.client import Client
from tests.cluster.local_cluster import SERVED_NAME, start_cluster
from worker.loader import LoadedModel


def test_summary_reports_medians_and_tails_in_milliseconds() -> None:
    timings = Timings(ttft=[0.010, 0.002, 0.003, 0.004, 0.005], gaps=[0.001] * 9 + [0.009])
    timings.per_token = [0.001] * 9 + [0.009]
    out = summary(timings)
    assert out["ttft_p50_ms"] == 4.0
    assert out["ttft_p90_ms"] == 10.0
    assert out["token_p50_ms"] == 1.0 and out["token_p90_ms"] == 9.0
    assert out["gap_p50_ms"] == 1.0 and "ttft_first_text_p50_ms" not in out
    assert percentile([3.0], 0.99) == 3.0


def test_per_token_time_spans_first_to_last_token_whatever_the_chunking() -> None:
    timings = Timings()
    timings.add(began=0.0, first=0.5, stamps=[0.6, 1.0, 1.5], tokens=5)  # 3 chunks, 5 tokens
    assert timings.ttft == [0.5] and timings.per_token == [0.25]
    assert timings.gaps == [0.4, 0.5]


def test_the_grpc_and_http_paths_alternate_on_different_prompts(tiny: LoadedModel) -> None:
    assert [p.split(":")[0] for p in prompts(2, 0, 2) + prompts(2, 1, 2)] == [
        "Request 0", "Request 2", "Request 1", "Request 3",
    ]  # fmt: skip
    cluster = start_cluster(tiny, workers=1, http=True)
    try:
        with httpx2.Client(base_url=cluster.http_url, timeout=30, trust_env=False) as http:
            over_grpc, over_http = alternating(
                Client(cluster.target), http, SERVED_NAME, count=3, tokens=4
            )
    finally:
        cluster.close()
    for timings in (over_grpc, over_http):
        assert len(timings.ttft) == len(timings.per_token) == 3
        assert all(t > 0 for t in timings.ttft) and all(t >= 0 for t in timings.per_token)
    assert len(over_grpc.gaps) == 3 * 3  # one message per token
    assert len(over_http.first_text) == 3
    pairs = zip(over_http.ttft, over_http.first_text, strict=True)
    assert all(start <= text for start, text in pairs)  # the response starts, then text comes
    assert "ttft_first_text_p50_ms" in summary(over_http)
