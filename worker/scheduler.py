"""Which tokens the next step computes: running samples first, then admissions, in a budget.

    step budget (tokens): [ running, oldest first: 1 token each decoding, a chunk if prefilling ]
                          [ waiting, FIFO: admitted while slots, pages and budget allow       ]

Admission goes through the cache's protocol (`start`: match, lock, map, allocate with
eviction) and allocates the whole prompt's pages, so a prefill is never preempted for want of
its own pages. A running sample that cannot grow by the pages it needs preempts the youngest
running sample (possibly itself): its computed KV goes to the cache, its pages are freed, and it
waits at the head of the queue to resume, mostly from the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cache import OutOfPages, OutOfSlots, SequenceCache
from cache.sequences import PageCopy
from cache.tiers import TierCopy
from worker.samples import Phase, SampleState


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    token_budget: int = 512
    """Tokens computed per step: prefill chunks and decodes together."""
    max_prefill_chunk: int = 512
    """The longest piece of one sample's prompt in one step."""
    max_running: int = 64

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_prefill_chunk", "max_running"):
            if getattr(self, name) < 1:  # 0 would schedule nothing, forever
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(
        self,
        cache: SequenceCache,
        config: SchedulerConfig,
        copy_pages: Callable[[list[TierCopy | PageCopy]], None],
        from_disk: Callable[[SampleState], None] | None = None,
    ) -> None:
        self.cache = cache
        self.config = config
        self.copy_pages = copy_pages
        self.from_disk = from_disk
        """Called once per sample before its first start: read saved KV that extends it."""
        self.waiting: deque[SampleState] = deque()
        self.running: list[SampleState] = []
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def enqueue(self, sample: SampleState, front: bool = False) -> None:
        sample.phase = Phase.WAITING
        if front:
            self.waiting.appendleft(sample)
        else:
            self.waiting.append(sample)

    def remove(self, sample: SampleState) -> None:
        """Take a sample out of the queues (its sequence, if any, is the caller's to end)."""
        if sample.phase is Phase.RUNNING:
            self.running.remove(sample)
        elif sample.phase is Phase.WAITING:
            self.waiting.remove(sample)

    def schedule(self) -> list[tuple[SampleState, int]]:
        """The (sample, tokens to compute) of the next step, in a stable order."""
        budget, plan = self.config.token_budget, []
        i = 0
        while i < len(self.running) and budget > 0:
            sample = self.running[i]
            take = min(sample.pending, budget, self.config.max_prefill_chunk)
            if not self._make_room(sample, sample.computed + take):
                continue  # `sample` itself was preempted; the list shifted under i
            plan.append((sample, take))
            budget -= take
            i += 1
        while budget > 0 and self.waiting and len(self.running) < self.config.max_running:
            sample = self.waiting[0]
            if not self._admit(sample):
                break
            self.waiting.popleft()
            self.running.append(sample)
            take = min(sample.pending, budget, self.config.max_prefill_chunk)
            plan.append((sample, take))
            budget -= take
        return plan

    def _admit(self, sample: SampleState) -> bool:
        request = sample.request.request
        if self.from_disk is not None and not sample.disk_checked:
            sample.disk_checked = True
            self.from_disk(sample)
        try:
            seq = self.cache.start(
                sample.tokens,
                request.namespace,
                reserve=len(sample.tokens),
                block_hashes=request.prompt_block_hashes,
            )
        except (OutOfPages, OutOfSlots):
            return False
        self.copy_pages(self.cache.take_page_copies(seq))
        sample.seq, sample.computed, sample.prefilled = seq, seq.reused, False
        sample.phase = Phase.RUNNING
        if not sample.request.admitted:
            sample.request.admitted = True
            # a resumed sample's ids end with generated tokens: its cache hit counts the prompt
            sample.request.cached_prompt_tokens = min(seq.reused, sample.request.prompt_tokens)
            sample.request.host_cached_tokens = min(
                seq.host_reused, sample.request.cached_prompt_tokens
            )
        return True

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
        sample.seq, sample.computed = None, 0
        self.enqueue(sample, front=True)
        self.preemptions += 1
