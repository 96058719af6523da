"""Routing with saved caches: the index keeps a worker's blocks that only its disk holds (`saved`
/ `unsaved` events beside a real cache's own), cache_aware prices such a hit by its read
against recomputing elsewhere, and the service model learns the read rate from first tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import KvEvent, KvEventKind, KvSnapshot
from router.cache_aware import CacheAware
from router.service_model import ServiceModel, ServiceRates
from tests.router.helpers import RATE, Worker, prompt, request
from tests.router.test_host_tier_routing import cluster, tiered

HISTORY = prompt(21, 800)


def saved(worker: Worker) -> frozenset[int]:
    """Publish what a worker's engine publishes after a save: its cache's blocks, `saved`."""
    blocks = frozenset(worker.cache.tree.snapshot().block_hashes)
    worker.cache.events.publish(KvEventKind.SAVED, blocks)
    return blocks


def on_disk_alone(policy: CacheAware, name: str = "w1") -> Worker:
    """`name` served HISTORY, saved it, then its cache dropped it; events delivered."""
    holder = Worker(name)
    holder.serve(HISTORY)
    saved(holder)
    holder.cache.tree.clear()
    holder.deliver(policy)
    return holder


def test_the_index_keeps_blocks_on_disk_after_the_cache_drops_them() -> None:
    policy = cluster()
    holder = on_disk_alone(policy)
    hashes = request("r", HISTORY).block_hashes
    bit = policy.members.bit["w1"]
    assert policy.index.depth(bit, hashes) == len(hashes), "held, on disk"
    assert policy.index.disk_from(bit, hashes, len(hashes)) == 0
    assert holder.serve([*HISTORY, 5]) == 0  # (a real engine would read it back first)
    holder.deliver(policy)  # stored again: in the cache, and still on disk
    assert policy.index.disk_from(bit, hashes, len(hashes)) == len(hashes)
    assert not policy.index.disk_holders
    holder.cache.events.publish(KvEventKind.UNSAVED, policy.index._sets["w1"].disk)
    holder.cache.tree.clear()
    holder.deliver(policy)
    assert not policy.index.holders and not policy.index.disk_holders


def test_a_snapshot_gives_the_same_index_as_the_events() -> None:
    policy = cluster()
    holder = on_disk_alone(policy)
    fresh = cluster()
    snapshot = holder.cache.tree.snapshot()
    fresh.load_snapshot("w1", replace(snapshot, disk_block_hashes=policy.index._sets["w1"].disk))
    assert fresh.index.holders == policy.index.holders
    assert fresh.index.disk_holders == policy.index.disk_holders
    fresh.load_snapshot("w1", KvSnapshot("w1", snapshot.seq + 1, frozenset()))
    assert not fresh.index.holders and not fresh.index.disk_holders


def test_a_fast_disk_hit_beats_recomputing_elsewhere() -> None:
    policy = cluster(disk_rate=100 * RATE)  # 800 tokens back in 8 ms; recompute: 0.8 s
    on_disk_alone(policy)
    decision = policy.route(request("t", prompt(22, 840, HISTORY)))
    assert decision.worker == "w1" and decision.predicted_cached_tokens == 800


def test_a_slow_disk_is_priced_as_recomputing_on_its_worker() -> None:
    """The worker recomputes what it would read slower (worker/tier_costs.py): a disk hit
    never costs more there than recomputing it."""
    policy = cluster(disk_rate=RATE / 4)  # 800 tokens back in 3.2 s; recompute: 0.8 s
    on_disk_alone(policy)
    hashes = request("r", HISTORY).block_hashes
    assert policy._tier_seconds("w1", hashes, 800) == 800 / RATE
    assert policy.route(request("t", prompt(23, 840, HISTORY))).worker == "w1"


def test_each_tier_of_one_worker_is_priced_at_its_own_rate() -> None:
    """Device, then host, then disk alone along one chain: only the host and disk parts cost
    a transfer, each at its rate."""
    policy = cluster(disk_rate=2 * RATE, host_rate=4 * RATE)
    holder = tiered("w1")
    holder.serve(HISTORY)
    saved(holder)
    holder.cache.tree.clear()
    holder.serve(HISTORY[:400])  # the first half back in the cache
    holder.cache.tree.evict(holder.cache.tree.evictable_pages)  # to the host
    holder.serve(HISTORY[:200])  # its first quarter back on the device
    holder.deliver(policy)
    hashes = request("r", HISTORY).block_hashes
    bit = policy.members.bit["w1"]
    assert policy.index.disk_from(bit, hashes, len(hashes)) == 100
    assert policy.index.host_from(bit, hashes, 100) == 50
    seconds = policy._tier_seconds("w1", hashes, 800)
    assert seconds == pytest.approx(200 / (4 * RATE) + 400 / (2 * RATE))
    assert policy._tier_seconds("w1", hashes, 300) == pytest.approx(100 / (4 * RATE))
    assert policy._tier_seconds("w1", hashes, 150) == 0.0


def test_calibration_sets_the_disk_rate() -> None:
    policy = cluster()
    assert policy.disk_rate == 4 * RATE  # the default guess
    policy.calibrate(ServiceRates(RATE, 0.0, None, 3 * RATE))
    assert policy.disk_rate == 3 * RATE
    policy.calibrate(ServiceRates(RATE, 0.0))  # a model that learned nothing of disks
    assert policy.disk_rate == 3 * RATE


def test_the_service_model_learns_the_disk_rate_from_first_tokens() -> None:
    model = ServiceModel(RATE, min_samples=4, host_rate=4000.0, disk_rate=50 * RATE)
    for uncached in (100, 300, 500, 700, 900, 200):  # 2 ms overhead + 1 ms a token
        model.observe_first_token(uncached, 0, 0.002 + uncached / RATE)
    for disk in (400, 800, 1200, 1600):  # the disk at 2,000 tokens/s, beside 400 host tokens
        seconds = 0.002 + 40 / RATE + 400 / 4000.0 + disk / 2000.0
        model.observe_first_token(40, 0, seconds, host_tokens=400, disk_tokens=disk)
    assert abs(model.prefill_rate - RATE) < 1.0, "disk first tokens stay out of the prefill fit"
    assert abs(model.disk_rate - 2000.0) < 20.0
    assert model.host_rate == 4000.0, "nor do they teach the host rate"
    assert model.rates().disk_rate == model.disk_rate


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "saved", "unsaved", "cleared", "snapshot"]),
        st.sets(st.integers(0, 11), max_size=5),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_holders_are_always_the_cache_or_disk_blocks_of_each_worker(events: list) -> None:
    """Any order of events, snapshots between them: a block is held iff the worker's cache or
    disk has it, on disk alone iff its disk has it and its cache does not."""
    policy = cluster()
    cache: set[int] = set()
    disk: set[int] = set()
    seq = 0
    for kind, blocks in events:
        seq += 1
        if kind == "snapshot":  # the worker's state as a snapshot after this many events
            snapshot = KvSnapshot("w1", seq, frozenset(cache), frozenset(), frozenset(disk))
            policy.load_snapshot("w1", snapshot)
            continue
        event_kind = KvEventKind(kind)
        hashes = tuple(sorted(blocks))
        if event_kind is KvEventKind.STORED:
            cache |= blocks
        elif event_kind is KvEventKind.REMOVED:
            cache -= blocks
        elif event_kind is KvEventKind.SAVED:
            disk |= blocks
        elif event_kind is KvEventKind.UNSAVED:
            disk -= blocks
        else:
            cache.clear()
            hashes = ()
        assert policy.apply_event("w1", KvEvent("w1", seq, event_kind, hashes))
        bit = 1 << policy.members.bit["w1"]
        held = {b for b, mask in policy.index.holders.items() if mask & bit}
        alone = {b for b, mask in policy.index.disk_holders.items() if mask & bit}
        assert held == cache | disk and alone == disk - cache
    policy.remove_worker("w1")
    assert not policy.index.holders and not policy.index.disk_holders


def test_unconfigured_tier_rates_follow_the_learned_prefill_rate() -> None:
    model = ServiceModel(RATE, min_samples=4)
    for uncached in (100, 300, 500, 700, 900, 200):  # a worker 5 times the configured guess
        model.observe_first_token(uncached, 0, 0.002 + uncached / (5 * RATE))
    assert abs(model.prefill_rate - 5 * RATE) < 5.0
    assert model.disk_rate == pytest.approx(4 * model.prefill_rate)
    assert model.host_rate == pytest.approx(10 * model.prefill_rate)
    configured = ServiceModel(RATE, min_samples=4, disk_rate=1234.0)
    assert configured.disk_rate == 1234.0, "a configured rate stands until learned"
