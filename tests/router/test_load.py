"""The load book: tokens counted at routing, free_at drained at the prefill rate, FCFS."""

from __future__ import annotations

import pytest

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
