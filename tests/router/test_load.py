"""The load book: tokens counted at routing, free_at drained at the prefill rate, FCFS."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.load import LoadBook


def book() -> LoadBook:
    loads = LoadBook(prefill_rate=1000.0)
    loads.add("a", 0, 10_000, 0.0)
    loads.add("b", 1, 10_000, 0.0)
    return loads


def test_routes_queue_and_prefills_drain_first_come_first_served() -> None:
    loads = book()
    loads.routed("r1", "a", 500, 600, now=0.0)
    loads.routed("r2", "a", 300, 300, now=0.1)
    assert loads.workers["a"].queued_tokens == 800 and loads.queued_tokens == 800
    assert loads.wait_s("a", 0.1) == pytest.approx(0.7)  # 0.5 + 0.3 from t=0, seen at 0.1
    assert loads.by_free[0] == (0.0, 1)  # b, idle, first
    loads.prefill_done("r1", now=0.6)  # a little late: r2 starts now
    assert loads.wait_s("a", 0.6) == pytest.approx(0.3)
    assert loads.workers["a"].kv_tokens == 600
    loads.finished("r1", now=1.0)
    assert loads.workers["a"].kv_tokens == 0 and loads.workers["a"].running == 1


def test_abort_before_prefill_takes_its_work_out_of_the_queue() -> None:
    loads = book()
    loads.routed("r1", "b", 1000, 1000, now=0.0)
    loads.routed("r2", "b", 1000, 1000, now=0.0)
    assert loads.finished("r2", now=0.5)
    assert loads.wait_s("b", 0.5) == pytest.approx(0.5)
    assert loads.queued_tokens == 1000
    assert not loads.finished("r2", now=0.6)  # already gone
    assert not loads.prefill_done("nope", now=0.6)


def test_removing_a_worker_forgets_its_routes_and_order() -> None:
    loads = book()
    loads.routed("r1", "a", 100, 100, now=0.0)
    loads.remove("a")
    assert [bit for _, bit in loads.by_free] == [1] and loads.queued_tokens == 0
    assert loads.worker_of("r1") is None


def test_routing_an_id_in_flight_again_ends_its_earlier_booking() -> None:
    """A retried or reused request id: the earlier booking must not stay queued for good."""
    loads = book()
    loads.routed("r", "a", 500, 500, now=0.0)
    loads.routed("r", "b", 300, 300, now=0.0)
    assert (loads.workers["a"].queued_tokens, loads.workers["a"].running) == (0, 0)
    assert loads.wait_s("a", 0.0) == 0.0 and loads.queued_tokens == 300
    assert loads.prefill_done("r", now=0.3) and loads.finished("r", now=0.4)
    assert all(s.queued_tokens == s.running == s.kv_tokens == 0 for s in loads.workers.values())
    assert loads.queued_tokens == 0


def test_a_request_waits_only_for_the_queue_of_its_priority_or_a_more_urgent_one() -> None:
    loads = book()
    loads.routed("urgent", "a", 400, 400, now=0.0)  # priority 0
    loads.routed("batch", "a", 600, 600, now=0.0, priority=1)
    state = loads.workers["a"]
    assert loads.prioritized == 1 and state.by_priority == {1: 600}
    assert LoadBook.ahead(state, 0) == pytest.approx(0.4)
    assert LoadBook.ahead(state, 1) == LoadBook.ahead(state, 5) == 1.0
    assert LoadBook.ahead(state, -1) == 0.0  # more urgent than everything queued
    assert LoadBook.ahead(loads.workers["b"], 0) == 1.0  # nothing queued
    loads.prefill_done("batch", now=0.6)
    assert loads.prioritized == 0 and state.by_priority == {}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "prefill", "finish", "remove"]),
            st.integers(0, 5),  # request id
            st.sampled_from(["a", "b"]),
            st.integers(0, 900),  # prefill tokens
            st.integers(-1, 2),  # priority
        ),
        max_size=40,
    )
)
def test_priority_books_balance_through_any_routes(
    ops: list[tuple[str, int, str, int, int]],
) -> None:
    """Whatever is routed, prefilled, finished, re-routed or lost with its worker: each worker's
    tokens by priority are those of its queued routes, the count of queued routes at a priority
    other than 0 is exact, and everything ends at zero."""
    loads, now = book(), 0.0
    for op, rid, worker, tokens, priority in ops:
        now += 0.01
        request_id = f"r{rid}"
        if op == "route" and worker in loads.workers:
            loads.routed(request_id, worker, tokens, tokens, now, priority)
        elif op == "prefill":
            loads.prefill_done(request_id, now)
        elif op == "finish":
            loads.finished(request_id, now)
        elif op == "remove" and worker in loads.workers and len(loads.workers) > 1:
            loads.remove(worker)
        queued = [r for r in loads._routes.values() if not r.prefilled]
        assert loads.prioritized == sum(1 for r in queued if r.priority and r.prefill_tokens)
        for name, state in loads.workers.items():
            mine = [r for r in queued if r.worker == name and r.priority]
            expected: dict[int, int] = {}
            for r in mine:
                expected[r.priority] = expected.get(r.priority, 0) + r.prefill_tokens
            assert {p: t for p, t in state.by_priority.items() if t} == {
                p: t for p, t in expected.items() if t
            }
            assert 0.0 <= LoadBook.ahead(state, 0) <= 1.0
    for request_id in list(loads._routes):
        loads.finished(request_id, now)
    assert loads.prioritized == 0
    assert all(not state.by_priority for state in loads.workers.values())
