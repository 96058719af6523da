"""A request the router sends away from the worker holding its prefix (as when that worker is
busy) is served from the holder's KV, read over gRPC, not recomputed: real engines behind real
gRPC servers on loopback, the real router service and its index fed by the workers' events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cluster.client import Client, text_request
from cluster.config import RouterSection
from router.interface import RouteDecision, RouteRequest
from tests.cluster.local_cluster import LocalCluster, start_cluster
from tests.cluster.test_serving import SYSTEM, assert_no_leak, collect
from worker.loader import LoadedModel

PROMPT = SYSTEM * 4


@pytest.fixture
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny, router=RouterSection(port=0, peer_kv_min_tokens=16))
    yield running
    running.close()


def indexed(cluster: LocalCluster, worker: str, timeout: float = 10) -> None:
    """Until the router's index has blocks of `worker` (its events arrive on their own)."""
    deadline = time.monotonic() + timeout
    while cluster.links.policy.index.blocks(worker) == 0:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"no blocks of {worker} reached the router"
        time.sleep(0.02)


def routed_to(cluster: LocalCluster, worker: str) -> None:
    """Every request goes to `worker`, whatever the policy would say (the rest of the route,
    the request's kv_peer included, is the service's own)."""

    def choose(request: RouteRequest, now: float) -> RouteDecision:
        return RouteDecision(worker, 0)

    cluster.links.policy.choose = choose  # type: ignore[method-assign, attr-defined]


def test_a_request_routed_away_from_its_prefix_reads_it_from_the_holder(
    cluster: LocalCluster,
) -> None:
    client = Client(cluster.target)
    first = collect(client, text_request(PROMPT + "First?", max_tokens=4))[-1]
    holder = first.worker
    other = next(name for name in cluster.engines if name != holder)
    indexed(cluster, holder)
    routed_to(cluster, other)
    second = collect(client, text_request(PROMPT + "Second?", max_tokens=6))
    assert {r.worker for r in second} == {other}
    cached = second[-1].cached_prompt_tokens
    assert cached >= 32, "the shared prefix came from the holder's cache"
    assert second[-1].peer_cached_tokens == cached, "and the response says it was read"
    workers = {w.worker: w for w in cluster.stats().workers}
    assert workers[other].peer_read_tokens == cached
    assert workers[other].peer_read_failures == 0
    routed_to(cluster, holder)
    on_holder = collect(client, text_request(PROMPT + "Second?", max_tokens=6))
    tokens = [t for r in second for t in r.token_ids]
    assert tokens == [t for r in on_holder for t in r.token_ids], "the answer the holder gives"
    assert_no_leak(cluster)


def test_without_a_peer_the_moved_request_recomputes_its_prefix(cluster: LocalCluster) -> None:
    cluster.service.config = replace(cluster.service.config, peer_kv_min_tokens=0)  # never
    client = Client(cluster.target)
    first = collect(client, text_request(PROMPT + "First?", max_tokens=4))[-1]
    other = next(name for name in cluster.engines if name != first.worker)
    indexed(cluster, first.worker)
    routed_to(cluster, other)
    second = collect(client, text_request(PROMPT + "Second?", max_tokens=4))[-1]
    assert second.worker == other and second.cached_prompt_tokens == 0
    assert {w.worker: w for w in cluster.stats().workers}[other].peer_read_tokens == 0
    assert_no_leak(cluster)
