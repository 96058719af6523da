"""`radixmesh loadtest --server-metrics` (cluster/loadtest/server_metrics.py): the cluster's own
latency percentiles, scraped over HTTP from a real local cluster's router and workers before and
after a run, beside the client's: one observation per request the run sent (the warmup's left
out), no later than the client saw it; percentiles read from buckets as `histogram_quantile`
reads them; an endpoint that cannot be read ends the command before the run, naming it."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.registry import Collector

from cluster.loadtest.cli import add_arguments, main
from cluster.loadtest.server_metrics import Buckets, parse, summary
from cluster.router_metrics import RouterCollector
from tests.cluster.local_cluster import LocalCluster, start_cluster
from tests.cluster.test_loadtest import consistent
from worker.latency_metrics import LATENCY_BUCKETS, histogram
from worker.loader import LoadedModel
from worker.metrics import EngineCollector


@pytest.fixture(scope="module")
def served(tiny: LoadedModel) -> Iterator[tuple[LocalCluster, list[str]]]:
    """Two workers; the router's and each worker's metrics on HTTP endpoints of their own."""
    cluster = start_cluster(tiny)
    collectors: list[Collector] = [RouterCollector(cluster.service)]
    collectors += [EngineCollector(engine, name) for name, engine in cluster.engines.items()]
    servers, urls = [], []
    for collector in collectors:
        registry = CollectorRegistry()
        registry.register(collector)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.server_port}/metrics")
    try:
        yield cluster, urls
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        cluster.close()


def loadtest(target: str, out: Path, *extra: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--target", target, "--output-dir", str(out), "--max-tokens", "6", *extra]
    code = main(parser.parse_args(argv))
    return code, json.loads((out / "report.json").read_text()) if code == 0 else {}


def test_the_report_puts_the_clusters_percentiles_beside_the_clients(
    served: tuple[LocalCluster, list[str]], tmp_path: Path
) -> None:
    cluster, urls = served
    code, report = loadtest(
        cluster.target, tmp_path, "--num-requests", "24", "--concurrency", "4", "--warmup", "6",
        "--server-metrics", *urls,
    )  # fmt: skip
    assert code == 0
    (run,) = report["runs"]
    client = consistent(run)
    server = client["server"]
    completed = client["requests"]["completed"]
    assert completed == 24
    for row in ("TTFT", "latency", "worker queue", "worker prefill", "worker TTFT"):
        assert server[row]["observations"] == completed, row  # the warmup's are not in them
    assert server["inter-token"]["observations"] == completed * (6 - 1)
    # each router figure is no later than its client's: the router's median estimate lies at
    # most at the top of the bucket the client's median falls in
    client_p50 = client["ttft_ms"]["p50"] / 1000
    top = min(le for le in LATENCY_BUCKETS if le >= client_p50)
    assert server["TTFT"]["p50"] <= 1000 * top
    for row in server.values():
        assert row["p50"] <= row["p90"] <= row["p99"]
    text = (tmp_path / "summary.md").read_text()
    assert "As the cluster measured it" in text and "| TTFT p50 / p90 / p99 (n) |" in text


def test_an_unreadable_endpoint_ends_the_command_before_the_run(
    served: tuple[LocalCluster, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, urls = served
    gone = urls[0].rsplit(":", 1)[0] + ":1/metrics"
    code, _ = loadtest(cluster.target, tmp_path, "--num-requests", "2", "--server-metrics", gone)
    assert code == 2
    assert f"--server-metrics: cannot read {gone}" in capsys.readouterr().err.replace("\n", "")
    code, _ = loadtest(cluster.target, tmp_path, "--server-metrics", "127.0.0.1:9400")
    assert code == 2
    assert "--server-metrics 127.0.0.1:9400 is not an http(s):// URL" in capsys.readouterr().err


@given(st.lists(st.floats(0.0, 700.0), min_size=1, max_size=200), st.sampled_from([0.5, 0.9, 0.99]))
def test_a_percentile_lies_in_the_bucket_of_the_true_one(values: list[float], q: float) -> None:
    """As Prometheus reads it: interpolated inside the bucket that holds the rank-th value,
    the highest finite bound when that is the +Inf bucket."""
    h = histogram("x_seconds", "x", LATENCY_BUCKETS)
    for value in values:
        h.observe(value)
    registry = CollectorRegistry()
    registry.register(h)
    buckets = parse(generate_latest(registry).decode())["x_seconds"]
    estimate = buckets.quantile(q)
    assert estimate is not None
    ordered = sorted(values)
    true = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
    bounds = [0.0, *LATENCY_BUCKETS, math.inf]
    upper = min(b for b in bounds[1:] if b >= true)
    lower = bounds[bounds.index(upper) - 1]
    if math.isinf(upper):
        assert estimate == LATENCY_BUCKETS[-1]
    else:
        assert lower <= estimate <= upper


def test_no_observation_is_no_percentile_and_a_restart_is_said() -> None:
    assert Buckets().quantile(0.5) is None
    ttft = "radixmesh_router_time_to_first_token_seconds"
    queue = "radixmesh_worker_request_queue_seconds"
    router = {ttft: Buckets(5, 1.0, {1.0: 5, math.inf: 5})}
    quiet = summary([router], [router])
    assert quiet == {"TTFT": {"observations": 0, "p50": None, "p90": None, "p99": None}}
    restarted = {ttft: Buckets(2, 0.2, {1.0: 2, math.inf: 2})}
    assert summary([router], [restarted]) == {"TTFT": {"reset": True}}
    # two workers: one restarted, the other served more than the first lost; the sum alone
    # would look like 3 observations
    one, other = Buckets(4, 1.0, {1.0: 4, math.inf: 4}), Buckets(1, 0.1, {1.0: 1, math.inf: 1})
    before = [{queue: one}, {queue: other}]
    after = [
        {queue: Buckets(1, 0.1, {1.0: 1, math.inf: 1})},
        {queue: Buckets(7, 1, {1.0: 7, math.inf: 7})},
    ]
    assert summary(before, after) == {"worker queue": {"reset": True}}
    both = summary(before, [{queue: one.plus(other)}, {queue: other.plus(one)}])
    assert both["worker queue"]["observations"] == 5  # type: ignore[index]
