"""Routing with reads from other workers' caches: `deeper_holder` (which other worker's
device holds more of a request's prompt, for the router to name as its `kv_peer`), and the
read rate the service model learns and the policy is calibrated with. Real caches publish the
events the index is built from."""

from __future__ import annotations

from dataclasses import replace

from cache import KvEvent, KvEventKind
from router.cache_aware import CacheAware
from router.round_robin import RoundRobin
from router.service_model import ServiceModel, ServiceRates
from tests.router.helpers import BLOCK, CONFIG, RATE, Clock, Worker, prompt, request
from tests.router.test_disk_tier_routing import saved
from tests.router.test_host_tier_routing import HISTORY, demoted


def three(policy: CacheAware | None = None) -> CacheAware:
    policy = policy or CacheAware(CONFIG, Clock())
    for w in range(3):
        policy.add_worker(f"w{w}", 100_000)
    return policy


def test_the_deepest_other_holder_is_named_with_the_positions_it_holds() -> None:
    policy = three()
    deep, shallow = Worker("w1"), Worker("w2")
    deep.serve(HISTORY)
    shallow.serve(HISTORY[:400])
    for worker in (deep, shallow):
        worker.deliver(policy)
    ask = request("r", [*HISTORY, 9, 9])
    assert policy.deeper_holder(ask, "w0") == ("w1", 800)
    assert policy.deeper_holder(ask, "w2") == ("w1", 800)
    assert policy.deeper_holder(ask, "w2", least=400) == ("w1", 800)
    assert policy.deeper_holder(ask, "w2", least=401) is None, "w2 holds 400 of them"
    assert policy.deeper_holder(ask, "w1") is None, "nobody holds more than w1"
    assert policy.deeper_holder(request("r", HISTORY[:400]), "w2") is None, "as much is not more"
    assert policy.deeper_holder(request("r", prompt(5, 300)), "w0") is None, "nobody holds it"


def test_the_positions_stop_short_of_the_prompts_last_token() -> None:
    policy = three()
    holder = Worker("w1")
    holder.serve(HISTORY)
    holder.deliver(policy)
    assert policy.deeper_holder(request("r", HISTORY), "w0") == ("w1", len(HISTORY) - 1)


def test_only_a_device_tier_counts_not_a_host_tier_or_a_saved_cache() -> None:
    policy = three()
    demoted(policy, "w1")  # all of HISTORY on w1's host tier: a peer sends device pages only
    ask = request("r", [*HISTORY, 9])
    assert policy.index.depth(policy.members.bit["w1"], ask.block_hashes) == 800 // BLOCK
    assert policy.deeper_holder(ask, "w0") is None
    extra = prompt(3, 400)
    on_disk = Worker("w2")
    on_disk.serve([*HISTORY, *extra])
    saved(on_disk)
    on_disk.cache.tree.clear()
    on_disk.deliver(policy)
    ask = request("r", [*HISTORY, *extra, 9])
    assert policy.index.depth(policy.members.bit["w2"], ask.block_hashes) == 1200 // BLOCK
    assert policy.deeper_holder(ask, "w0") is None, "w2 holds it on disk alone"
    on_device = Worker("w0")
    on_device.serve([*HISTORY, *extra])
    on_device.deliver(policy)
    assert policy.deeper_holder(ask, "w1") == ("w0", 1200), "more than w1's host holds"


def test_a_removed_worker_is_never_named_and_a_blind_policy_names_none() -> None:
    policy = three()
    holder = Worker("w1")
    holder.serve(HISTORY)
    holder.deliver(policy)
    policy.remove_worker("w1")
    assert policy.deeper_holder(request("r", [*HISTORY, 9]), "w0") is None
    blind = RoundRobin(CONFIG, Clock())
    blind.add_worker("w0", 100_000)
    blind.add_worker("w1", 100_000)
    holder.deliver(blind)
    assert blind.deeper_holder(request("r", [*HISTORY, 9]), "w0") is None


def test_a_worker_whose_events_have_a_gap_is_not_named_until_its_snapshot() -> None:
    policy = three()
    holder = Worker("w1")
    holder.serve(HISTORY)
    holder.deliver(policy)
    ask = request("r", [*HISTORY, 9])
    lost = KvEvent("w1", 10_000, KvEventKind.REMOVED, ())  # events before it were lost
    assert not policy.apply_event("w1", lost)
    assert policy.deeper_holder(ask, "w0") is None, "its blocks may be gone"
    policy.load_snapshot("w1", holder.cache.tree.snapshot())
    assert policy.deeper_holder(ask, "w0") == ("w1", 800)


def test_the_service_model_learns_the_peer_rate_and_keeps_reads_out_of_the_prefill_fit() -> None:
    model = ServiceModel(RATE, min_samples=4, peer_rate=20 * RATE)
    for uncached in (100, 300, 500, 700, 900, 200):  # 2 ms overhead + 1 ms a token
        model.observe_first_token(uncached, 0, 0.002 + uncached / RATE)
    for read in (400, 800, 1200, 1600):  # reads at 6,000 tokens/s
        model.observe_first_token(40, 0, 0.002 + 40 / RATE + read / 6000.0, peer_tokens=read)
    assert abs(model.prefill_rate - RATE) < 1.0, "first tokens with reads stay out of the fit"
    assert abs(model.peer_rate - 6000.0) < 60.0  # type: ignore[operator]
    assert model.rates().peer_rate == model.peer_rate
    unpriced = ServiceModel(RATE, min_samples=4)
    assert unpriced.peer_rate is None and unpriced.rates().peer_rate is None


def test_calibration_sets_the_peer_rate_only_where_reads_are_priced() -> None:
    priced = CacheAware(replace(CONFIG, peer_rate=10 * RATE), Clock())
    priced.calibrate(ServiceRates(RATE, 0.0, peer_rate=6 * RATE))
    assert priced.peer_rate == 6 * RATE
    priced.calibrate(ServiceRates(RATE, 0.0))  # a model that learned nothing of reads
    assert priced.peer_rate == 6 * RATE
    unpriced = CacheAware(CONFIG, Clock())
    unpriced.calibrate(ServiceRates(RATE, 0.0, peer_rate=6 * RATE))
    assert unpriced.peer_rate is None


def test_a_read_beside_a_host_hit_is_priced_without_the_host_tokens_time() -> None:
    model = ServiceModel(RATE, min_samples=4, host_rate=4000.0, peer_rate=20 * RATE)
    for uncached in (100, 300, 500, 700, 900, 200):  # 2 ms overhead + 1 ms a token
        model.observe_first_token(uncached, 0, 0.002 + uncached / RATE)
    for read in (400, 800, 1200, 1600):  # 400 host tokens at 4,000/s, reads at 6,000/s
        seconds = 0.002 + 40 / RATE + 400 / 4000.0 + read / 6000.0
        model.observe_first_token(40, 0, seconds, host_tokens=400, peer_tokens=read)
    assert abs(model.peer_rate - 6000.0) < 60.0  # type: ignore[operator]
    assert model.host_rate == 4000.0, "the host rate is not taught by them"
