"""Routing with host tiers: the index learns where each worker's blocks live from its real
events, and cache_aware prices a host hit by its transfer against recomputing elsewhere."""

from __future__ import annotations

from dataclasses import replace

from cache import CacheConfig, KvEventKind, SequenceCache
from router.cache_aware import CacheAware
from router.service_model import ServiceModel, ServiceRates
from tests.router.helpers import BLOCK, CONFIG, RATE, Clock, Worker, prompt, request

HISTORY = prompt(11, 800)


def tiered(name: str) -> Worker:
    """A worker whose cache has a host tier as large as its device pool."""
    worker = Worker(name)
    config = CacheConfig(4097, 1, max_sequences=8, block_size=BLOCK, host_pages=4097)
    worker.cache = SequenceCache(config, source=name)
    worker.cache.events.subscribe(worker.events.append)
    return worker


def cluster(**rates: float | None) -> CacheAware:
    """Two workers; `rates`: RouterConfig's tier rates (host_rate, disk_rate)."""
    policy = CacheAware(replace(CONFIG, **rates), Clock())
    for w in range(2):
        policy.add_worker(f"w{w}", 100_000)
    return policy


def demoted(policy: CacheAware, name: str = "w1") -> Worker:
    """`name` served HISTORY, then its device pool evicted it to the host; events delivered."""
    holder = tiered(name)
    holder.serve(HISTORY)
    holder.cache.tree.evict(holder.cache.tree.evictable_pages)
    assert any(e.kind is KvEventKind.DEMOTED for e in holder.events)
    holder.deliver(policy)
    return holder


def test_the_index_follows_blocks_to_the_host_and_back() -> None:
    policy = cluster()
    holder = demoted(policy)
    hashes = request("r", HISTORY).block_hashes
    bit = policy.members.bit["w1"]
    assert policy.index.depth(bit, hashes) == len(hashes), "still held, on the host"
    assert policy.index.host_from(bit, hashes, len(hashes)) == 0
    fresh = cluster()  # the same knowledge from a snapshot
    fresh.load_snapshot("w1", holder.cache.tree.snapshot())
    assert fresh.index.host_holders == policy.index.host_holders
    assert holder.serve([*HISTORY, 5]) == 800, "promoted for the request"
    holder.deliver(policy)
    assert policy.index.host_from(bit, hashes, len(hashes)) == len(hashes)
    assert not policy.index.host_holders
    policy.remove_worker("w1")
    assert not policy.index.holders


def test_a_fast_host_hit_beats_recomputing_elsewhere() -> None:
    policy = cluster(host_rate=100 * RATE)  # 800 tokens back in 8 ms; recompute: 0.8 s
    demoted(policy)
    assert policy.route(request("t", prompt(12, 840, HISTORY))).worker == "w1"


def test_a_host_hit_slower_than_recomputing_is_not_preferred() -> None:
    policy = cluster(host_rate=RATE / 4)  # 800 tokens back in 3.2 s; recompute: 0.84 s
    demoted(policy)
    assert policy.route(request("t", prompt(13, 840, HISTORY))).worker == "w0"


def test_a_device_holder_beats_a_host_holder() -> None:
    policy = cluster(host_rate=10 * RATE)
    demoted(policy, "w1")
    device = Worker("w0")
    device.serve(HISTORY)
    device.deliver(policy)
    decision = policy.route(request("t", prompt(14, 840, HISTORY)))
    assert decision.worker == "w0" and decision.predicted_cached_tokens == 800


def test_calibration_sets_the_host_rate() -> None:
    policy = cluster()
    assert policy.host_rate == 10 * RATE  # the default guess
    policy.calibrate(ServiceRates(RATE, 0.0, 3 * RATE))
    assert policy.host_rate == 3 * RATE
    policy.calibrate(ServiceRates(RATE, 0.0))  # a model that learned nothing of hosts
    assert policy.host_rate == 3 * RATE


def test_the_service_model_learns_the_host_rate_from_first_tokens() -> None:
    model = ServiceModel(RATE, min_samples=4, host_rate=50 * RATE)
    assert model.host_rate == 50 * RATE
    for uncached in (100, 300, 500, 700, 900, 200):  # 2 ms overhead + 1 ms a token
        model.observe_first_token(uncached, 0, 0.002 + uncached / RATE)
    for host in (400, 800, 1200, 1600):  # and the host tier at 2,000 tokens/s
        model.observe_first_token(40, 0, 0.002 + 40 / RATE + host / 2000.0, host)
    assert abs(model.prefill_rate - RATE) < 1.0, "host first tokens stay out of the prefill fit"
    assert abs(model.host_rate - 2000.0) < 20.0
    assert model.rates().host_rate == model.host_rate
