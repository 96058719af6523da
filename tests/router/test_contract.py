"""Every registered policy honours the RoutingPolicy contract (router/interface.py)."""

from __future__ import annotations

import pytest

from cache import KvEvent, KvEventKind, KvSnapshot
from router.errors import DuplicateWorker, NoWorkers, UnknownPolicy, UnknownWorker
from router.interface import RoutingPolicy
from router.policies import DEFAULT_POLICY, POLICIES, make_policy
from tests.router.helpers import CONFIG, Clock, prompt, request

NAMES = sorted(POLICIES)


def cluster(name: str, workers: int = 4) -> tuple[RoutingPolicy, Clock]:
    clock = Clock()
    policy = make_policy(name, CONFIG, clock)
    for w in range(workers):
        policy.add_worker(f"w{w}", 10_000)
    return policy, clock


def test_registry() -> None:
    assert DEFAULT_POLICY == "cache_aware"
    assert {"round_robin", "least_load", "consistent_hash", "cache_aware", "sglang"} <= set(NAMES)
    with pytest.raises(UnknownPolicy, match="known: cache_aware"):
        make_policy("nope")
    assert make_policy().name == "cache_aware"


@pytest.mark.parametrize("name", NAMES)
def test_routes_to_members_with_sane_predictions(name: str) -> None:
    policy, clock = cluster(name)
    assert policy.name == name
    for i in range(40):
        clock.now = i * 0.01
        r = request(str(i), prompt(i % 5, 37))
        decision = policy.route(r)
        assert decision.worker in {"w0", "w1", "w2", "w3"}
        assert 0 <= decision.predicted_cached_tokens < r.num_tokens
        policy.prefill_done(decision.worker, r.request_id)
        policy.finished(decision.worker, r.request_id)
    assert policy.index_bytes() >= 0


@pytest.mark.parametrize("name", NAMES)
def test_membership_errors_and_removal(name: str) -> None:
    policy, _ = cluster(name, 2)
    with pytest.raises(DuplicateWorker, match="w0"):
        policy.add_worker("w0", 1)
    with pytest.raises(UnknownWorker, match="'w9' is not a member \\(2 workers are\\)"):
        policy.prefill_done("w9", "x")
    with pytest.raises(UnknownWorker):
        policy.apply_event("w9", KvEvent("w9", 1, KvEventKind.CLEARED, ()))
    policy.remove_worker("w1")
    assert {policy.route(request(str(i), prompt(i, 9))).worker for i in range(20)} == {"w0"}
    policy.remove_worker("w0")
    with pytest.raises(NoWorkers, match="'late'"):
        policy.route(request("late", prompt(1, 9)))


@pytest.mark.parametrize("name", NAMES)
def test_unknown_requests_are_ignored_and_bursts_route_everyone_once(name: str) -> None:
    policy, _ = cluster(name)
    policy.prefill_done("w0", "never-routed")
    policy.finished("w0", "never-routed")
    burst = [request(str(i), prompt(i, 4 + 9 * i)) for i in range(6)]
    routed = policy.route_burst(burst)
    assert sorted(r.request_id for r, _ in routed) == [str(i) for i in range(6)]
    assert all(d.worker in {"w0", "w1", "w2", "w3"} for _, d in routed)


@pytest.mark.parametrize("name", NAMES)
def test_events_and_snapshots_are_accepted(name: str) -> None:
    policy, _ = cluster(name, 1)
    hashes = request("a", prompt(1, 12)).block_hashes
    assert policy.apply_event("w0", KvEvent("w0", 1, KvEventKind.STORED, hashes))
    policy.load_snapshot("w0", KvSnapshot("w0", 1, frozenset(hashes)))
    assert policy.apply_event("w0", KvEvent("w0", 2, KvEventKind.REMOVED, hashes[1:]))


def test_bad_config_and_requests_are_refused_by_name() -> None:
    from router.config import RouterConfig
    from router.interface import RouteRequest

    with pytest.raises(ValueError, match="prefill_rate"):
        RouterConfig(prefill_rate=float("nan"))  # every cost would be NaN: no worker ties
    with pytest.raises(ValueError, match="pending_ttl_s"):
        RouterConfig(pending_ttl_s=float("nan"))  # routes would never expire
    with pytest.raises(ValueError, match=r"'r'.*num_tokens"):
        RouteRequest("r", request("r", [1]).namespace, (), -5)
