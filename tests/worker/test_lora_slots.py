"""Adapter slots: LRU swapping, pins that protect a slot, replacement and removal while in use;
then long random runs against a model of the rules, with every invariant checked each step."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from worker.lora_adapter import AdapterError, LoraAdapter
from worker.lora_slots import AdapterSlots


def make_adapter(name: str, seed: int, rank: int = 4) -> LoraAdapter:
    """A real adapter record with seeded random factors for one projection."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(rank, 8, generator=generator)
    b = torch.randn(8, rank, generator=generator)
    digest = hashlib.blake2b(a.numpy().tobytes() + b.numpy().tobytes(), digest_size=8)
    return LoraAdapter(
        name,
        f"/adapters/{name}",
        rank,
        2.0 * rank,
        2.0,
        digest.hexdigest(),
        {(0, "q_proj"): (a, b)},
    )


class DeviceWeights:
    """Stands for the device stacks: what each slot holds, and every copy into one."""

    def __init__(self, slots: int) -> None:
        self.held: list[str | None] = [None] * slots
        self.loads: list[tuple[int, str]] = []

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        self.held[slot] = adapter.identity
        self.loads.append((slot, adapter.identity))

    def clear(self, slot: int) -> None:
        self.held[slot] = None


def _slots(count: int = 2) -> tuple[AdapterSlots, DeviceWeights]:
    weights = DeviceWeights(count)
    return AdapterSlots(count, 8, weights), weights


def test_least_recently_used_unpinned_slot_is_swapped_out() -> None:
    slots, weights = _slots(2)
    for name in "abc":
        slots.add(make_adapter(name, ord(name)))
    assert slots.acquire("a") == 0 and slots.acquire("b") == 1
    assert slots.acquire("a") == 0  # a is now the most recent
    assert slots.acquire("c") == 1  # b was the least recently used
    assert slots.resident() == ["a", "c"]
    assert weights.held == [slots.adapters["a"].identity, slots.adapters["c"].identity]
    assert slots.swaps == 3 and len(weights.loads) == 3


def test_a_pinned_slot_is_never_taken_and_every_pinned_slot_means_wait() -> None:
    slots, weights = _slots(2)
    for name in "abc":
        slots.add(make_adapter(name, ord(name)))
    slots.pin(slots.acquire("a") or 0)
    assert slots.acquire("b") == 1
    slots.pin(1)
    assert slots.acquire("c") is None  # both pinned: c waits
    assert weights.held == [slots.adapters["a"].identity, slots.adapters["b"].identity]
    slots.unpin(0)
    assert slots.acquire("c") == 0  # a, unpinned, was the only candidate though b is older
    with pytest.raises(ValueError, match="holds no pin"):
        slots.unpin(0)


def test_replacing_a_pinned_adapter_frees_its_slot_with_the_last_pin() -> None:
    slots, weights = _slots(2)
    old = make_adapter("a", 1)
    slots.add(old)
    slot = slots.acquire("a")
    assert slot is not None
    slots.pin(slot)
    slots.pin(slot)
    new = make_adapter("a", 2)
    assert slots.add(new) is old
    assert slots.holder(slot) is old and slots.resident() == []  # old still serves its samples
    assert slots.acquire("a") == 1 and weights.held[1] == new.identity
    slots.unpin(slot)
    assert slots.holder(slot) is old
    slots.unpin(slot)
    assert slots.holder(slot) is None and weights.held[slot] is None
    assert slots.slot_of(old.identity) is None


def test_the_same_weights_again_keep_their_slot_and_removal_waits_for_pins() -> None:
    slots, weights = _slots(2)
    slots.add(make_adapter("a", 1))
    slot = slots.acquire("a")
    assert slot is not None
    again = make_adapter("a", 1)
    slots.add(again)
    assert slots.holder(slot) is again and slots.swaps == 1  # nothing copied again
    slots.pin(slot)
    assert slots.remove("a") is again
    assert slots.holder(slot) is again and slots.info() == []
    with pytest.raises(KeyError):
        slots.acquire("a")
    slots.unpin(slot)
    assert slots.holder(slot) is None and weights.held == [None, None]


def test_swap_time_is_an_average_of_measured_copies() -> None:
    ticks = iter([0.0, 1.0, 10.0, 10.5])
    slots = AdapterSlots(1, 8, None, clock=lambda: next(ticks))
    slots.add(make_adapter("a", 1))
    slots.add(make_adapter("b", 2))
    slots.acquire("a")
    assert slots.swap_seconds == 1.0
    slots.acquire("b")
    assert slots.swap_seconds == pytest.approx(0.8 * 1.0 + 0.2 * 0.5)
    assert slots.swap_seconds_total == pytest.approx(1.5)


def test_an_adapter_above_the_rank_limit_is_refused() -> None:
    slots, _ = _slots(2)
    with pytest.raises(AdapterError, match="rank 16 is above max_lora_rank 8"):
        slots.add(make_adapter("big", 1, rank=16))
    assert slots.info() == []


NAMES = ["a", "b", "c", "d"]
STEPS = {"count": 0, "waits": 0, "evictions": 0, "retired_while_pinned": 0}


class SlotMachine(RuleBasedStateMachine):
    """Random add / remove / acquire / pin / unpin against a plain model of the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 3
        self.weights = DeviceWeights(self.count)
        self.slots = AdapterSlots(self.count, 8, self.weights)
        self.registered: dict[str, str] = {}
        """name -> identity, as the model expects."""
        self.pinned: list[tuple[int, str]] = []
        """(slot, identity) per pin held by a simulated running sample."""
        self.last_use: dict[str, int] = {}
        """identity -> model time of its last acquire."""
        self.clock = 0

    @rule(name=st.sampled_from(NAMES), seed=st.integers(0, 2))
    def add(self, name: str, seed: int) -> None:
        adapter = make_adapter(name, seed)
        old = self.registered.get(name)
        if old is not None and old != adapter.identity and self._pins_of(old):
            STEPS["retired_while_pinned"] += 1
        self.slots.add(adapter)
        self.registered[name] = adapter.identity

    @precondition(lambda self: self.registered)
    @rule(pick=st.integers(0, 100))
    def remove(self, pick: int) -> None:
        name = sorted(self.registered)[pick % len(self.registered)]
        assert self.slots.remove(name).identity == self.registered.pop(name)

    @precondition(lambda self: self.registered)
    @rule(pick=st.integers(0, 100), pin=st.booleans())
    def acquire(self, pick: int, pin: bool) -> None:
        name = sorted(self.registered)[pick % len(self.registered)]
        identity = self.registered[name]
        before = {s: self.slots.holder(s) for s in range(self.count)}
        was = self.slots.slot_of(identity)
        slot = self.slots.acquire(name)
        occupied = [s for s, a in before.items() if a is not None]
        if was is not None:
            assert slot == was, "a resident adapter moved"
        elif slot is None:
            STEPS["waits"] += 1
            assert len(occupied) == self.count, "waited with a free slot"
            assert all(self.slots.pins(s) for s in occupied), "waited with an unpinned slot"
        else:
            victim = before[slot]
            if victim is not None:
                STEPS["evictions"] += 1
                assert len(occupied) == self.count, "evicted with a free slot"
                unpinned = [before[s] for s in occupied if self.slots.pins(s) == 0]
                oldest = min(unpinned, key=lambda a: self.last_use[a.identity])  # type: ignore[union-attr]
                assert victim is oldest, "not the least recently used unpinned adapter"
            assert self.weights.held[slot] == identity, "acquired without copying it in"
        if slot is None:
            return
        self.clock += 1
        self.last_use[identity] = self.clock
        if pin:
            self.slots.pin(slot)
            self.pinned.append((slot, identity))

    @precondition(lambda self: self.pinned)
    @rule(pick=st.integers(0, 100))
    def unpin(self, pick: int) -> None:
        slot, _ = self.pinned.pop(pick % len(self.pinned))
        self.slots.unpin(slot)

    def _pins_of(self, identity: str) -> int:
        return sum(1 for _, i in self.pinned if i == identity)

    @invariant()
    def consistent(self) -> None:
        STEPS["count"] += 1
        slots = self.slots
        held = [slots.holder(s) for s in range(self.count)]
        identities = [a.identity for a in held if a is not None]
        assert len(identities) == len(set(identities)), "one adapter in two slots"
        for s, adapter in enumerate(held):
            want = sum(1 for slot, _ in self.pinned if slot == s)
            assert slots.pins(s) == want >= 0, f"slot {s}: {slots.pins(s)} pins, {want} held"
            if adapter is None:
                assert want == 0 and self.weights.held[s] is None
                continue
            assert slots.slot_of(adapter.identity) == s
            assert self.weights.held[s] == adapter.identity, "device weights differ"
            registered = self.registered.get(adapter.name) == adapter.identity
            assert registered or want, f"a retired adapter keeps slot {s} with no pin"
        for slot, identity in self.pinned:  # a pinned slot is never reassigned
            holder = held[slot]
            assert holder is not None and holder.identity == identity
        order = slots.lru_order()
        assert sorted(order) == [s for s, a in enumerate(held) if a is not None]
        times = [self.last_use[held[s].identity] for s in order]  # type: ignore[union-attr]
        assert times == sorted(times), "LRU order differs from the order of use"
        resident = {i for i in identities}
        assert sorted(slots.resident()) == sorted(
            n for n, i in self.registered.items() if i in resident
        )


def test_random_operations_keep_every_slot_invariant() -> None:
    STEPS.update(dict.fromkeys(STEPS, 0))
    run_state_machine_as_test(
        SlotMachine, settings=settings(max_examples=80, stateful_step_count=60, deadline=None)
    )
    assert STEPS["count"] >= 3000
    assert STEPS["waits"] and STEPS["evictions"] and STEPS["retired_while_pinned"], STEPS
