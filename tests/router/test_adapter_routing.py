"""Routing LoRA requests: only workers holding the adapter serve it; cache_aware prices a swap
into a slot (the worker's reported seconds) so an adapter's requests gather where it is
resident, while a busy holder still spills to one that must swap it in."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import CacheNamespace
from router.adapters import AdapterBook, WorkerAdapters
from router.cache_aware import CacheAware
from router.config import RouterConfig
from router.policies import POLICIES, make_policy
from tests.router.helpers import BLOCK, CONFIG, RATE, Clock, Worker, prompt, request

A_ID, B_ID = "shouty@1f2e", "terse@9a0b"
A, B = CacheNamespace(adapter=A_ID), CacheNamespace(adapter=B_ID)


def cluster(workers: int = 4, **knobs: object) -> tuple[CacheAware, Clock]:
    clock = Clock()
    policy = CacheAware(CONFIG, clock, **knobs)  # type: ignore[arg-type]
    for w in range(workers):
        policy.add_worker(f"w{w}", 100_000)
    return policy, clock


def report_all(policy: CacheAware, resident: dict[str, set[str]], swap_s: float = 0.5) -> None:
    """Every worker holds both adapters; `resident` says which sit in slots where."""
    held = {A_ID, B_ID}
    for worker in policy.members.order:
        policy.report_adapters(
            worker,
            WorkerAdapters.of(held, resident.get(worker, set()), swap_s),
        )


def test_only_workers_holding_the_adapter_are_candidates() -> None:
    policy, clock = cluster(4)
    policy.report_adapters("w1", WorkerAdapters.of({A_ID}))
    policy.report_adapters("w3", WorkerAdapters.of({A_ID}))
    lora: set[str] = set()
    base: set[str] = set()
    for i in range(24):
        clock.now = i * 0.01
        lora.add(policy.route(request(f"a{i}", prompt(i, 200), A)).worker)
        base.add(policy.route(request(f"b{i}", prompt(100 + i, 200))).worker)
    assert lora == {"w1", "w3"}  # spread over both holders, never elsewhere
    assert {"w0", "w2"} <= base  # the base model runs anywhere (here: where it is idle)


def test_requests_gather_where_their_adapter_is_resident() -> None:
    aware, _ = cluster(4)
    blind, _ = cluster(4, adapter_swaps=False)
    for policy in (aware, blind):
        report_all(policy, {"w2": {A_ID}, "w0": {B_ID}})
    aware_workers: set[str] = set()
    blind_workers: set[str] = set()
    for i in range(16):  # new prompts nobody caches, each finished before the next
        r = request(str(i), prompt(i, 40), A)
        for policy, seen in ((aware, aware_workers), (blind, blind_workers)):
            worker = policy.route(r).worker
            seen.add(worker)
            policy.prefill_done(worker, r.request_id)
            policy.finished(worker, r.request_id)
    assert aware_workers == {"w2"}
    assert len(blind_workers) > 1  # rendezvous spreads new prefixes, paying swaps


def test_a_busy_resident_worker_spills_to_one_that_swaps_the_adapter_in() -> None:
    policy, clock = cluster(2)
    report_all(policy, {"w0": {A_ID}}, swap_s=0.2)
    first = policy.route(request("long", prompt(1, 2000), A))  # 2 s of prefill queued on w0
    assert first.worker == "w0"
    clock.now = 0.01
    second = policy.route(request("next", prompt(2, 40), A))
    assert second.worker == "w1"  # 0.2 s swap + 0.04 s beats 1.99 s of waiting
    # the router follows its own route: the adapter is resident on w1 now, no swap priced
    assert policy.adapters.swap_s("w1", A_ID) == 0.0


@pytest.mark.parametrize(("swap_s", "expected"), [(3.0, "w0"), (0.01, "w1")])
def test_the_reported_swap_seconds_decide_between_waiting_and_swapping(
    swap_s: float, expected: str
) -> None:
    policy, clock = cluster(2)
    report_all(policy, {"w0": {A_ID}}, swap_s=swap_s)
    policy.route(request("queued", prompt(1, 1000, None), A))  # 1 s queued on w0
    clock.now = 0.001
    assert policy.route(request("next", prompt(2, 40), A)).worker == expected


def test_an_adapters_cached_prefix_still_wins_over_residency() -> None:
    """A worker holding the request's prefix (in the adapter's namespace) saves prefill."""
    policy, _ = cluster(2)
    report_all(policy, {"w0": {A_ID}}, swap_s=0.05)
    holder = Worker("w1")
    shared = prompt(7, 800)
    holder.serve(shared, A)
    holder.deliver(policy)
    decision = policy.route(request("r", prompt(8, 840, shared), A))
    assert decision == decision.__class__("w1", 800 - 800 % BLOCK)


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"cache_aware"}))
def test_every_policy_keeps_a_lora_request_to_holders(name: str) -> None:
    clock = Clock()
    policy = make_policy(name, CONFIG, clock)
    for w in range(4):
        policy.add_worker(f"w{w}", 100_000)
    policy.report_adapters("w2", WorkerAdapters.of({A_ID}))
    for i in range(12):
        clock.now = i * 0.01
        assert policy.route(request(str(i), prompt(i, 64), A)).worker == "w2"


def test_an_adapter_nobody_holds_still_routes_somewhere() -> None:
    """The router refuses unknown adapters before routing; a race (its last holder left) ends
    at a worker that refuses it by name, never in a policy error."""
    policy, _ = cluster(3)
    assert policy.route(request("r", prompt(1, 40), B)).worker in {"w0", "w1", "w2"}


def test_the_book_tracks_holders_slots_and_leaving_workers() -> None:
    book = AdapterBook(default_swap_s=0.07)
    book.add("w0", 0)
    book.add("w1", 1)
    book.report("w0", WorkerAdapters.of({"a@1", "b@2", "c@3"}, {"a@1", "b@2"}, 0.0))
    book.report("w1", WorkerAdapters.of({"a@1"}, (), 0.3))
    assert (book.holders("a@1"), book.holders("b@2"), book.holders("x@0")) == (0b11, 0b01, 0)
    assert book.swap_s("w0", "a@1") == 0.0 and book.swap_s("w0", "c@3") == 0.07  # unmeasured
    assert book.swap_s("w1", "a@1") == 0.3  # learned from its report
    book.routed("w0", "a@1")  # a is now the most recently used of w0's two slots
    book.routed("w0", "c@3")  # c swaps in: b, least recently routed, leaves
    assert book.swap_s("w0", "b@2") == 0.07 and book.swap_s("w0", "c@3") == 0.0
    book.routed("w1", "b@2")  # w1 does not hold b: nothing changes
    assert book.swap_s("w1", "b@2") == 0.3 and book.holders("b@2") == 0b01
    book.report("w0", WorkerAdapters.of({"c@3"}, {"c@3"}))  # a and b unloaded from w0
    assert (book.holders("a@1"), book.holders("b@2"), book.holders("c@3")) == (0b10, 0, 0b01)
    book.remove("w1")
    assert book.holders("a@1") == 0


def test_the_swap_default_comes_from_the_router_config() -> None:
    policy = CacheAware(RouterConfig(prefill_rate=RATE, block_tokens=BLOCK, adapter_swap_s=1.5))
    policy.add_worker("w0", 1000)
    policy.report_adapters("w0", WorkerAdapters.of({"a@1"}))
    assert policy.adapters.swap_s("w0", "a@1") == 1.5
    with pytest.raises(ValueError, match="adapter_swap_s"):
        RouterConfig(adapter_swap_s=-1.0)


IDS = [f"a{k}@d" for k in range(5)]
WORKERS = ["w0", "w1", "w2"]
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("report"),
            st.sampled_from(WORKERS),
            st.sets(st.sampled_from(IDS)),
            st.sets(st.sampled_from(IDS)),
        ),
        st.tuples(st.just("routed"), st.sampled_from(WORKERS), st.sampled_from(IDS)),
        st.tuples(st.just("remove"), st.sampled_from(WORKERS)),
        st.tuples(st.just("add"), st.sampled_from(WORKERS)),
    ),
    max_size=60,
)


@given(operations)
@settings(max_examples=300, deadline=None)
def test_the_book_agrees_with_what_each_worker_last_reported(ops: list[tuple[Any, ...]]) -> None:
    """After any sequence of reports, routes, joins and leaves: an adapter's holder mask is
    exactly the members whose last report held it; resident adapters are held, and never more
    than the most a worker reported resident at once (at least 1)."""
    book = AdapterBook()
    held: dict[str, set[str]] = {}
    most: dict[str, int] = {}
    for op in ops:
        worker = op[1]
        if op[0] == "add" and worker not in held:
            book.add(worker, WORKERS.index(worker))
            held[worker], most[worker] = set(), 1
        elif op[0] == "remove" and worker in held:
            book.remove(worker)
            del held[worker], most[worker]
        elif op[0] == "report" and worker in held:
            resident = op[3] & op[2]
            book.report(worker, WorkerAdapters.of(op[2], resident, 0.1))
            held[worker] = set(op[2])
            most[worker] = max(most[worker], len(resident))
        elif op[0] == "routed" and worker in held:
            book.routed(worker, op[2])
            if op[2] in held[worker]:
                assert book.swap_s(worker, op[2]) == 0.0  # resident once routed there
        for identity in IDS:
            expected = sum(1 << WORKERS.index(w) for w, ids in held.items() if identity in ids)
            assert book.holders(identity) == expected
        for w, state in book.workers.items():
            assert set(state.resident) <= held[w]
            assert len(state.resident) <= most[w]
