"""Which tokens the next step computes, in a budget. Under the default policy, FCFS, running
samples first, then admissions:

    step budget (tokens): [ running, oldest first: 1 token each decoding, a chunk if prefilling ]
                          [ waiting, FIFO: admitted while slots, pages and budget allow       ]

A waiting sample whose prompt begins with tokens that a running sample of its namespace is
computing right now (past what the cache held for it, at least `IN_BATCH_SHARED` of them) waits,
and the samples behind it with it (FIFO), until that prompt is computed and cached; it is then
admitted with those tokens read from the cache. Requests sent together with a shared prefix (a
system prompt, an instruction before every query) compute it once, not once each.

A sample of a LoRA adapter is admitted only once its adapter holds a device slot
(`AdapterSlots.acquire`), which it pins while it runs. When every slot is pinned it waits, and
the adapter samples behind it wait too (they queue for slots in FIFO order), but base-model
samples behind it are still admitted: a busy adapter never stalls the base model. A sample whose
adapter was unloaded (or replaced after it began) cannot run; it is handed back as `refused`.

Admission goes through the cache's protocol (`start`: match, lock, map, allocate with
eviction) and allocates the whole prompt's pages, so a prefill is never preempted for want of
its own pages. A running sample that cannot grow by the pages it needs preempts the youngest
running sample (possibly itself): its computed KV goes to the cache, its pages are freed, and it
waits at the head of the queue to resume, mostly from the cache.

With `policy="priority"` (vLLM's `--scheduling-policy priority`) every sample has a key,
(request priority, the order its request was first queued, sample index), lower first:

    step budget (tokens): [ running and waiting merged by key: a running sample computes its
                            chunk, a waiting one is admitted, preempting running samples of a
                            strictly lower priority (higher value) when it has no room        ]

Both queues stay sorted by key, so the sample a page shortage preempts is the last running
one: the lowest priority, and of those the youngest. A preempted sample waits at its key's
place, not at the head. Samples of one priority keep FCFS's order and never preempt each
other to be admitted.
"""

from __future__ import annotations

import logging
import time
from bisect import insort
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from enum import Enum
from itertools import count

from cache import CacheNamespace, Keys, OutOfPages, OutOfSlots, SequenceCache
from cache.sequences import PageCopy
from cache.tiers import QueuedCopy
from worker.lora_slots import AdapterSlots
from worker.samples import Phase, SampleState
from worker.validation import SCHEDULING_POLICIES

log = logging.getLogger(__name__)

IN_BATCH_SHARED = 32
"""Tokens (at least; a page when pages are longer) that a waiting sample must share, uncached,
with a prompt being computed to wait for it (`Scheduler._shares_a_prefill`): SGLang's
threshold for the same check."""


class Admission(Enum):
    ADMITTED = "admitted"
    NO_ROOM = "no room"
    """No pages or sequence slots: nothing behind it is admitted either (FIFO)."""
    NO_ADAPTER_SLOT = "no adapter slot"
    """Every adapter slot is pinned: it waits; base-model samples behind it may pass."""
    REFUSED = "refused"
    """Its adapter is gone: it can never run."""
    READING = "reading"
    """Its disk hit is being read: it waits; samples behind it may pass."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    token_budget: int = 512
    """Tokens computed per step: prefill chunks and decodes together."""
    max_prefill_chunk: int = 512
    """The longest piece of one sample's prompt in one step."""
    max_running: int = 64
    policy: str = "fcfs"
    """"fcfs": first come, first served, every request's priority 0; "priority": by each
    request's priority, lower first (module docstring)."""
    in_batch_shared: int = IN_BATCH_SHARED
    """Uncached tokens shared with a prompt being computed that hold a waiting sample back
    until it is cached (at least a page; 0: none do). FCFS only."""

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_prefill_chunk", "max_running"):
            if getattr(self, name) < 1:  # 0 would schedule nothing, forever
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}"
            )


def priority_key(sample: SampleState) -> tuple[int, int, int]:
    """Where a sample stands under the priority policy: lower first."""
    state = sample.request
    return state.request.priority, state.queue_order, sample.index


@dataclass(frozen=True, slots=True)
class Prefill:
    """A running prompt being computed, as a waiting one is compared with it."""

    namespace: CacheNamespace
    keys: Keys
    """Its prompt's cache keys."""
    shared: int
    """How many leading keys a waiting prompt must share with it to wait for it: its cache
    hit, then at least `IN_BATCH_SHARED` (and a page) computed now."""


class Scheduler:
    def __init__(
        self,
        cache: SequenceCache,
        config: SchedulerConfig,
        copy_pages: Callable[[list[QueuedCopy | PageCopy]], None],
        from_disk: Callable[[SampleState], bool | None] | None = None,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.cache = cache
        self.config = config
        self.copy_pages = copy_pages
        self.from_disk = from_disk
        """Called before a sample's first start: begins reading saved KV that extends it, or
        puts in the cache what was read; False while its read is in flight, None when no read
        may begin now."""
        self.adapters = adapters
        self.by_priority = config.policy == "priority"
        self._arrivals = count()
        self.waiting: deque[SampleState] | list[SampleState] = [] if self.by_priority else deque()
        self.running: list[SampleState] = []
        self.refused: list[SampleState] = []
        self.swap_failures: dict[str, str] = {}
        """Request id -> why its adapter could not be brought into a slot (the engine ends it
        with that message; left queued, it would fail the same way every step)."""
        """Waiting samples whose adapter is gone: the engine ends their requests."""
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def enqueue(self, sample: SampleState, front: bool = False) -> None:
        """Queue a sample: at the back, or `front` (preempted); by its key under the priority
        policy (which places a preempted sample by its old arrival)."""
        sample.phase = Phase.WAITING
        if sample.request.queue_order < 0:
            sample.request.queue_order = next(self._arrivals)
        if self.by_priority:
            insort(self.waiting, sample, key=priority_key)
        elif front:
            self.waiting.appendleft(sample)  # type: ignore[union-attr]
        else:
            self.waiting.append(sample)

    def add_running(self, sample: SampleState) -> None:
        """A sample now running (admitted, or forked from a running one)."""
        if self.by_priority:
            insort(self.running, sample, key=priority_key)
        else:
            self.running.append(sample)

    def remove(self, sample: SampleState) -> None:
        """Take a sample out of the queues (its sequence, if any, is the caller's to end)."""
        if sample.phase is Phase.RUNNING:
            self.running.remove(sample)
        elif sample.phase is Phase.WAITING:
            self.waiting.remove(sample)

    def schedule(self, skip: Collection[SampleState] = ()) -> list[tuple[SampleState, int]]:
        """The (sample, tokens to compute) of the next step, in a stable order. Running samples
        in `skip` (waiting for their images' encoder) sit the step out: no budget, no pages."""
        if self.by_priority:
            return self._schedule_by_priority(skip)
        budget, plan = self.config.token_budget, []
        i = 0
        while i < len(self.running) and budget > 0:
            sample = self.running[i]
            if sample in skip:
                i += 1
                continue
            take = min(sample.pending, budget, self.config.max_prefill_chunk)
            if not self._make_room(sample, sample.computed + take):
                continue  # `sample` itself was preempted; the list shifted under i
            plan.append((sample, take))
            budget -= take
            i += 1
        at, slots_busy = 0, False
        prefilling = self._prefilling() if self.waiting else []
        while budget > 0 and at < len(self.waiting) and len(self.running) < self.config.max_running:
            sample = self.waiting[at]
            if slots_busy and sample.request.adapter is not None:
                at += 1  # behind a sample waiting for a slot: its turn comes first
                continue
            if self._shares_a_prefill(sample, prefilling):
                break  # it waits for that prompt to be cached; what is behind it, for it (FIFO)
            admission = self._admit(sample)
            if admission is Admission.NO_ROOM:
                break
            if admission is Admission.NO_ADAPTER_SLOT:
                slots_busy, at = True, at + 1
                continue
            if admission is Admission.READING:
                at += 1
                continue
            if admission is Admission.REFUSED:  # stays queued until the engine ends it
                self.refused.append(sample)
                at += 1
                continue
            del self.waiting[at]
            self.add_running(sample)
            prefilling.extend(self._prefilling([sample]))
            take = min(sample.pending, budget, self.config.max_prefill_chunk)
            plan.append((sample, take))
            budget -= take
        return plan

    def _schedule_by_priority(self, skip: Collection[SampleState]) -> list[tuple[SampleState, int]]:
        """`schedule` under the priority policy: running and waiting samples merged by key.
        Every sample visited has a lower key than any preemption victim (the last running
        sample, the highest key), so nothing planned is ever preempted, and a victim is queued
        behind the waiting sample being visited."""
        budget, plan = self.config.token_budget, []
        i = at = 0
        blocked = slots_busy = False
        while budget > 0:
            running = self.running[i] if i < len(self.running) else None
            waiting = None if blocked or at >= len(self.waiting) else self.waiting[at]
            if waiting is not None and (
                running is None or priority_key(waiting) < priority_key(running)
            ):
                if slots_busy and waiting.request.adapter is not None:
                    admission = Admission.NO_ADAPTER_SLOT  # its turn for a slot comes first
                else:
                    admission = self._admit_over_lower(waiting)
                if admission is not Admission.ADMITTED:
                    blocked = admission is Admission.NO_ROOM  # nothing behind it passes
                    at += not blocked
                    slots_busy = slots_busy or admission is Admission.NO_ADAPTER_SLOT
                    if admission is Admission.REFUSED:  # stays queued until the engine ends it
                        self.refused.append(waiting)
                    continue
                del self.waiting[at]
                self.add_running(waiting)  # at i: every running sample before it is lower
                sample, take = waiting, min(waiting.pending, budget, self.config.max_prefill_chunk)
            elif running is None:
                break
            elif running in skip:
                i += 1
                continue
            else:
                sample, take = running, min(running.pending, budget, self.config.max_prefill_chunk)
                if not self._make_room(sample, sample.computed + take):
                    continue  # itself the lowest: preempted, queued behind what was visited
            plan.append((sample, take))
            budget -= take
            i += 1
        return plan

    def _admit_over_lower(self, sample: SampleState) -> Admission:
        """Admit `sample`, preempting running samples of a strictly lower priority (the last
        first) while it has no room or no free running slot; never while it waits for anything
        else (its disk read, an adapter slot), which a preemption would not bring. One that
        still has no room once every lower sample is preempted holds them back until it
        starts, as FCFS holds back whatever queues behind a request waiting for room."""
        mine = sample.request.request.priority
        while True:
            admission = self._admit(sample, full=len(self.running) >= self.config.max_running)
            if admission is not Admission.NO_ROOM:
                return admission
            if not self.running or self.running[-1].request.request.priority <= mine:
                return admission
            self.preempt(self.running[-1])

    def _prefilling(self, samples: Iterable[SampleState] | None = None) -> list[Prefill]:
        """The running `samples` (default: all) computing their prompt now, as
        `_shares_a_prefill` compares them. A prompt being scored is left out: it reuses nothing,
        so its cache hit says nothing of what is cached."""
        if not self.config.in_batch_shared:
            return []
        least = max(self.config.in_batch_shared, self.cache.page_size)
        return [
            Prefill(s.request.request.namespace, s.request.prompt_keys, s.seq.reused + least)
            for s in (self.running if samples is None else samples)
            if not s.prefilled and s.seq is not None and not s.request.scoring_prompt
        ]

    @staticmethod
    def _shares_a_prefill(sample: SampleState, prefilling: list[Prefill]) -> bool:
        """Whether a prompt being computed now computes, past its cache hit, `IN_BATCH_SHARED`
        or more tokens (a page at least) that begin `sample`'s prompt too, in the same
        namespace. Admitted now, `sample` would compute them a second time; admitted once that
        prompt is done (and committed), it reads them from the cache. A sample that scores its
        prompt (it reuses nothing) or that has begun a disk read never waits."""
        if not prefilling or sample.request.scoring_prompt or sample.disk_read is not None:
            return False
        keys, namespace = sample.request.prompt_keys, sample.request.request.namespace
        for other in prefilling:
            shared, theirs = other.shared, other.keys
            if shared > min(len(keys), len(theirs)) or keys[shared - 1] != theirs[shared - 1]:
                continue  # the last shared key first: most prompts differ there already
            if other.namespace == namespace and keys[:shared] == theirs[:shared]:
                return True
        return False

    def take_refused(self) -> list[SampleState]:
        refused, self.refused = self.refused, []
        return refused

    def _adapter_slot(self, sample: SampleState) -> int | Admission:
        """The slot for the sample's adapter (-1: none needed), or why there is none."""
        state = sample.request
        if state.adapter is None:
            return -1
        assert self.adapters is not None
        current = self.adapters.get(state.adapter.name)
        if current is None or current.identity != state.adapter.identity:
            if current is None or state.admitted:
                return Admission.REFUSED
            state.rebind(current)  # never ran: it takes its name's new weights
        try:
            slot = self.adapters.acquire(current.name)
        except Exception as err:  # e.g. out of device memory for its stacks
            log.exception("bringing adapter %r into a slot failed", current.name)
            self.swap_failures[state.request_id] = (
                f"adapter {current.name!r} could not be brought into a slot: "
                f"{type(err).__name__}: {err}"
            )
            return Admission.REFUSED
        return Admission.NO_ADAPTER_SLOT if slot is None else slot

    def hold_slot(self, sample: SampleState, slot: int) -> None:
        """`sample` runs on adapter slot `slot` (-1: none) until `release_slot`."""
        assert sample.lora_slot == -1
        if slot >= 0:
            assert self.adapters is not None
            self.adapters.pin(slot)
        sample.lora_slot = slot

    def release_slot(self, sample: SampleState) -> None:
        if sample.lora_slot >= 0:
            assert self.adapters is not None
            self.adapters.unpin(sample.lora_slot)
        sample.lora_slot = -1

    def _admit(self, sample: SampleState, full: bool = False) -> Admission:
        """`full`: every running slot is taken (NO_ROOM once nothing else holds it back)."""
        peer_read = sample.request.peer_read
        if (sample.disk_read is not None and not sample.disk_read.done()) or (
            peer_read is not None and not peer_read.done()
        ):
            return Admission.READING  # before its adapter takes a slot it cannot use yet
        slot = self._adapter_slot(sample)
        if isinstance(slot, Admission):
            return slot
        request = sample.request.request
        ready = None if full else True if self.from_disk is None else self.from_disk(sample)
        if not ready:  # no running slot, or no read may begin now; or its read is in flight
            return Admission.NO_ROOM if ready is None else Admission.READING
        try:
            seq = self.cache.start_keys(
                sample.cache_keys(),
                request.namespace,
                reserve=len(sample.tokens),
                block_hashes=sample.block_hashes,
                text=sample.request.images is None,  # keys from ids, which to_cache_keys checked
                reuse=not sample.request.scoring_prompt,  # each position's logits are wanted
            )
        except (OutOfPages, OutOfSlots):
            return Admission.NO_ROOM
        self.copy_pages(self.cache.take_page_copies(seq))
        sample.seq, sample.computed, sample.prefilled = seq, seq.reused, False
        sample.phase = Phase.RUNNING
        self.hold_slot(sample, slot)
        if not sample.request.admitted:
            sample.request.admitted = True
            sample.request.admitted_at = time.perf_counter()
            # a resumed sample's ids end with generated tokens: its cache hit counts the prompt
            sample.request.cached_prompt_tokens = min(seq.reused, sample.request.prompt_tokens)
            sample.request.host_cached_tokens = min(
                seq.host_reused, sample.request.cached_prompt_tokens
            )
            sample.request.disk_cached_tokens = min(
                sample.request.disk_cached_tokens,
                sample.request.cached_prompt_tokens - sample.request.host_cached_tokens,
            )
            sample.request.peer_cached_tokens = min(
                sample.request.peer_cached_tokens,
                sample.request.cached_prompt_tokens
                - sample.request.host_cached_tokens
                - sample.request.disk_cached_tokens,
            )
        return Admission.ADMITTED

    def _make_room(self, sample: SampleState, positions: int) -> bool:
        """Grow `sample` to `positions`, preempting the youngest; False if `sample` was it."""
        assert sample.seq is not None
        while True:
            try:
                self.cache.grow(sample.seq, positions)
                return True
            except OutOfPages:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is sample:
                    return False

    def preempt(self, sample: SampleState) -> None:
        """Free a running sample's pages (its computed KV stays cached) and requeue it first."""
        assert sample.seq is not None
        self.running.remove(sample)
        self.cache.finish(sample.seq, sample.computed)
        self.release_slot(sample)
        sample.seq, sample.computed = None, 0
        self.enqueue(sample, front=True)
        self.preemptions += 1
