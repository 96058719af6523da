"""cache_aware's behaviour: it follows the exact index and its pending routes, trades waiting
against recomputing, keeps load bounded under a hot prefix, and is deterministic."""

from __future__ import annotations

from dataclasses import replace

from router.cache_aware import CacheAware
from router.interface import RouteDecision, RouteRequest
from router.least_ttft import LeastTtft
from tests.router.helpers import CONFIG, RATE, Clock, Worker, prompt, request
from tests.router.test_host_tier_routing import HISTORY as HOST_HISTORY
from tests.router.test_host_tier_routing import demoted


def cluster(workers: int = 4, **knobs: object) -> tuple[CacheAware, Clock]:
    clock = Clock()
    policy = CacheAware(CONFIG, clock, **knobs)  # type: ignore[arg-type]
    for w in range(workers):
        policy.add_worker(f"w{w}", 100_000)
    return policy, clock


def test_burst_of_a_new_prefix_converges_before_any_event() -> None:
    policy, clock = cluster(8)
    shared = prompt(1, 400)
    workers = set()
    for i in range(8):
        clock.now = i * 0.001  # all within the holder's first prefill (0.4 s)
        decision = policy.route(request(str(i), prompt(100 + i, 420, shared)))
        workers.add(decision.worker)
        if i:
            assert decision.predicted_cached_tokens == 400  # pending: the shared blocks
    assert len(workers) == 1


def test_burst_through_route_burst_converges_too() -> None:
    policy, _ = cluster(8)
    shared = prompt(2, 400)
    routed = policy.route_burst([request(str(i), prompt(200 + i, 412, shared)) for i in range(6)])
    assert len({d.worker for _, d in routed}) == 1


def test_pending_routes_expire_after_the_grace_following_prefill_done() -> None:
    policy, clock = cluster(2)
    first = policy.route(request("a", prompt(3, 80)))
    assert policy.pending.holders
    clock.now = 0.5
    policy.prefill_done(first.worker, "a")
    clock.now = 0.5 + CONFIG.pending_grace_s + 0.01
    policy.route(request("b", prompt(4, 8)))  # any route expires what is due
    assert not policy.pending.holders.keys() & set(request("a", prompt(3, 80)).block_hashes)


def test_pending_routes_never_outlive_their_ttl() -> None:
    policy, clock = cluster(2)
    policy.route(request("lost", prompt(5, 80)))
    clock.now = CONFIG.pending_ttl_s + 1
    policy.route(request("later", prompt(6, 8)))
    assert len(policy.pending) == 1  # only "later"'s own entry


def test_goes_to_the_idle_holder_and_predicts_its_hit() -> None:
    policy, _ = cluster(3)
    holder = Worker("w1")
    history = prompt(7, 800)
    holder.serve(history)
    holder.deliver(policy)
    assert policy.route(request("t", prompt(70, 840, history))) == RouteDecision("w1", 800)


def test_waits_for_the_holder_up_to_one_plus_beta_times_the_saving() -> None:
    for beta, expected in ((0.0, "w0"), (1.0, "w1")):
        policy, _ = cluster(2, work_weight=beta, burst=False)
        holder = Worker("w1")
        history = prompt(9, 800)
        holder.serve(history)
        holder.deliver(policy)
        # queue 1.2 s of cold work on w1 (via the load book, as if routed earlier)
        policy.loads.routed("queued", "w1", 1200, 1200, 0.0)
        # recompute elsewhere: 0.84 s; wait at w1: 1.2 + 0.04 s; beta charges 0.8 s extra
        decision = policy.route(request("t", prompt(90, 840, history)))
        assert decision.worker == expected, beta


def test_ties_and_cold_prefixes_go_by_rendezvous_so_equal_prefixes_meet() -> None:
    chosen = []
    for _ in range(2):
        policy, _ = cluster(6)
        chosen.append([policy.route(request(str(i), prompt(i, 64))).worker for i in range(12)])
        for i, worker in enumerate(chosen[-1]):
            policy.finished(worker, str(i))
    assert chosen[0] == chosen[1]
    assert len(set(chosen[0])) > 1  # different prefixes spread out


def flood(policy: CacheAware, clock: Clock, check: float | None = None) -> float:
    """100 req/s of one 2000-token prefix + 25 new tokens (2.5 x one worker's prefill rate);
    returns the longest wait seen. With `check` = epsilon, asserts the guard at every route."""
    hot, longest = prompt(11, 2000), 0.0
    for i in range(300):
        clock.now = i * 0.01
        r = request(str(i), prompt(1000 + i, 2025, hot))
        waits = {w: policy.loads.wait_s(w, clock.now) for w in policy.members.order}
        decision = policy.route(r)
        longest = max(longest, waits[decision.worker])
        if check is not None:
            own = (r.num_tokens - decision.predicted_cached_tokens) / RATE
            bound = (1 + check) * (sum(waits.values()) + own) / len(waits) + policy.slack_s
            assert waits[decision.worker] <= bound + 1e-9
    return longest


def test_bounded_load_guard_holds_under_an_adversarial_hot_prefix() -> None:
    """A flood of one hot prefix, and a policy that values cache hits 10x (beta = 10, kept even
    for requests in the tail): without the guard a holder's queue passes 6 s; with it every
    choice stays within (1 + epsilon) x the mean wait + slack and the prefix spills."""
    knobs = {"work_weight": 10.0, "burst": False, "tail_free": False}
    unguarded, clock = cluster(4, epsilon=float("inf"), **knobs)
    assert flood(unguarded, clock) > 5.0
    guarded, clock = cluster(4, epsilon=0.5, slack_s=0.5, **knobs)
    assert flood(guarded, clock, check=0.5) < 2.5
    holders = {w for w in guarded.members.order if guarded.loads.workers[w].routed_tokens}
    assert len(holders) >= 3


def test_determinism_same_calls_same_decisions() -> None:
    def run() -> list[str]:
        policy, clock = cluster(5)
        out = []
        for i in range(60):
            clock.now = i * 0.05
            d = policy.route(request(str(i), prompt(i % 7, 40 + 13 * (i % 5), prompt(i % 3, 24))))
            out.append(d.worker)
            if i % 3 == 0:
                policy.prefill_done(d.worker, str(i))
        return out

    assert run() == run()


def test_burst_dispatch_order_very_long_first_then_shortest_first() -> None:
    policy, _ = cluster(4)
    sizes = [900, 40, 20_000, 300, 8]
    burst = [request(str(i), prompt(i, n)) for i, n in enumerate(sizes)]
    order = [r.request_id for r, _ in policy.route_burst(burst)]
    # fallback tail threshold 5 s = 5000 tokens here: the 20k request first, then by size
    assert order == ["2", "4", "1", "3", "0"]


def test_burst_keeps_a_later_members_home_free() -> None:
    """A very long cold member would take any idle worker; it leaves the one worker holding a
    later member's long history alone, so that member does not wait behind it."""
    policy, _ = cluster(2, burst=True)
    home = Worker("w0")
    history = prompt(12, 2000)
    home.serve(history)
    home.deliver(policy)
    cold = request("cold", prompt(13, 9000))
    warm = request("warm", prompt(14, 2040, history))
    routed = dict(policy.route_burst([warm, cold]))
    assert routed[cold].worker == "w1" and routed[warm].worker == "w0"


def test_least_ttft_is_cache_aware_without_the_later_costs() -> None:
    greedy = LeastTtft(CONFIG, Clock())
    assert greedy.work_weight == 0 and greedy.epsilon == float("inf") and not greedy.burst
    greedy.add_worker("w0", 10)
    blockless = RouteRequest("x", request("x", [1]).namespace, (), 1)
    assert greedy.route(blockless) == RouteDecision("w0", 0)


def test_calibrated_decode_cost_moves_a_request_off_a_busy_holder() -> None:
    """A holder with 7 running requests loses to an idle worker once they cost more than the
    prefill it saves plus the work term (7 x 0.1 s > 2 x 0.2 s); uncalibrated, it keeps it."""
    from router.service_model import ServiceRates

    shared = prompt(7, 200)
    for decode_s, expect_home in ((0.0, True), (0.04, True), (0.1, False)):
        policy, clock = cluster(2)
        home = policy.route(request("first", prompt(70, 220, shared))).worker
        policy.prefill_done(home, "first")
        for i in range(6):  # six more requests running (decoding) on the holder
            rid = f"busy{i}"
            routed = policy.route(request(rid, prompt(80 + i, 220, shared)))
            assert routed.worker == home
            policy.prefill_done(home, rid)
        clock.now = 0.5  # every prefill done, its blocks still pending: only running differs
        policy.calibrate(ServiceRates(RATE, decode_s))
        decision = policy.route(request("next", prompt(90, 220, shared)))
        assert (decision.worker == home) is expect_home
        assert decision.predicted_cached_tokens == (200 if expect_home else 0)


def test_a_burst_that_repeats_an_id_routes_every_entry_and_leaks_no_load() -> None:
    """Ids are the client's: a burst may repeat one. It must not fail half-routed (the burst's
    reservations are kept by position), and the repeat replaces the earlier booking."""
    policy, _ = cluster(2)
    home = Worker("w0")
    history = prompt(15, 200)
    home.serve(history)
    home.deliver(policy)
    twice = request("d", prompt(16, 240, history))
    routed = policy.route_burst([twice, twice, request("e", prompt(17, 30))])
    assert [r.request_id for r, _ in routed].count("d") == 2
    for r, d in routed:
        policy.prefill_done(d.worker, r.request_id)
        policy.finished(d.worker, r.request_id)
    states = policy.loads.workers.values()
    assert all(s.queued_tokens == s.running == s.kv_tokens == 0 for s in states)


def test_calibrated_decode_cost_looks_past_the_longest_idle_workers() -> None:
    """Six idle workers, one group of cold candidates (more than `scan`): the four idle longest
    each run five decoding requests, the two idle since later run none. Uncalibrated they all
    tie; once each running request costs 50 ms, the new request goes to one of the two."""
    from router.service_model import ServiceRates

    for decode_s, expected in ((0.0, {"w0", "w1", "w2", "w3"}), (0.05, {"w4", "w5"})):
        policy, clock = cluster(6)
        for w in range(6):
            rids = [f"w{w}.{j}" for j in range(5 if w < 4 else 1)]
            for rid in rids:
                policy.loads.routed(rid, f"w{w}", 10, 10, 0.0 if w < 4 else 1.0)
                policy.loads.prefill_done(rid, 0.01 if w < 4 else 1.01)
            if w >= 4:
                policy.loads.finished(rids[0], 1.02)
        clock.now = 2.0
        policy.calibrate(ServiceRates(RATE, decode_s))
        assert policy.route(request("r", prompt(1, 40))).worker in expected, decode_s


def test_an_urgent_request_waits_only_for_the_queue_ahead_of_it() -> None:
    """Under the workers' priority policy a queue of less urgent work does not delay a request:
    the holder of its prefix is worth it while that queue would not be (`RouteRequest.priority`,
    the load book's share of the queue ahead)."""
    for queued_priority, priority, expected in ((0, 0, "w0"), (1, 1, "w0"), (1, 0, "w1")):
        policy, _ = cluster(2, work_weight=0.0, burst=False)
        holder = Worker("w1")
        history = prompt(9, 800)
        holder.serve(history)
        holder.deliver(policy)
        # 1.2 s of cold work queued on w1 at `queued_priority`
        policy.loads.routed("queued", "w1", 1200, 1200, 0.0, queued_priority)
        urgent = replace(request("t", prompt(90, 840, history)), priority=priority)
        decision = policy.route(urgent)
        assert decision.worker == expected, (queued_priority, priority)
        if expected == "w1":
            assert decision.predicted_cached_tokens == 800


def busy_holder(
    peer_rate: float | None, least: int, queued: int
) -> tuple[CacheAware, RouteRequest]:
    """Two workers, w1 holding an 800-token prefix with `queued` tokens of cold work queued
    (1 ms a token), and a request continuing the prefix, under reads priced at `peer_rate`."""
    config = replace(CONFIG, peer_rate=peer_rate, peer_min_tokens=least)
    policy = CacheAware(config, Clock(), burst=False)
    for w in range(2):
        policy.add_worker(f"w{w}", 100_000)
    holder = Worker("w1")
    history = prompt(9, 800)
    holder.serve(history)
    holder.deliver(policy)
    policy.loads.routed("queued", "w1", queued, queued, 0.0)
    return policy, request("t", prompt(90, 840, history))


def test_a_priced_peer_read_moves_a_request_off_a_busy_holder() -> None:
    """With beta 1, 1.2 s queued on the holder keeps the request there when a move means
    recomputing its 800-token prefix (0.84 s + 0.8 s of work term); read at 10x the prefill
    rate, the move costs 0.04 s + 0.08 s + 0.08 s and the request goes to the idle worker,
    predicted to serve the read prefix from cache."""
    for peer_rate, expected in ((None, RouteDecision("w1", 800)), (10 * RATE, None)):
        policy, ask = busy_holder(peer_rate, 256, 1200)
        assert policy.deeper_holder(ask, "w0", 256) == ("w1", 800), "w0 would be told to read"
        assert policy.route(ask) == (expected or RouteDecision("w0", 800)), peer_rate


def test_a_gap_under_the_least_read_or_a_read_slower_than_recomputing_is_not_priced() -> None:
    """1.2 s queued on the holder: unpriced, the request stays; 2 s: it moves, to recompute.
    A read under the least, or no faster than recomputing, prices nothing either way (a read
    at half the prefill rate, priced, would have kept the second request at its holder)."""
    for queued, expected in ((1200, RouteDecision("w1", 800)), (2000, RouteDecision("w0", 0))):
        for peer_rate, least in ((None, 256), (10 * RATE, 801), (RATE, 256), (RATE / 2, 256)):
            policy, ask = busy_holder(peer_rate, least, queued)
            assert policy.route(ask) == expected, (queued, peer_rate, least)


def test_a_prefix_on_a_host_tier_alone_is_never_priced_as_a_read() -> None:
    """A peer sends what its device holds: with the holder's prefix demoted to its host tier,
    a read rate changes no decision and no prediction."""
    decisions = []
    for peer_rate in (None, 10 * RATE):
        policy = CacheAware(replace(CONFIG, peer_rate=peer_rate), Clock(), burst=False)
        for w in range(2):
            policy.add_worker(f"w{w}", 100_000)
        demoted(policy, "w1")
        policy.loads.routed("queued", "w1", 1200, 1200, 0.0)
        decisions.append(policy.route(request("t", [*HOST_HISTORY, 5, 6])))
    assert decisions[0] == decisions[1], decisions
