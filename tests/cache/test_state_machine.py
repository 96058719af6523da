"""Long random runs of the sequence protocol, with every invariant checked after every step.

The machine plays an engine: it starts prompts (shared prefixes, several namespaces, images,
exact duplicates of running prompts, repeats of finished ones for full hits), computes KV in
chunks, commits, samples, grows, forks, finishes, aborts and evicts, on a pool small enough that
eviction and refusals happen all the time. After each step: page conservation with no page in two
states, exact lock counts, every cached node reachable and filed correctly, and the KV events
replayed into a fresh index equal to the tree's own block set.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache import (
    BlockSetIndex,
    CacheConfig,
    CachedSequence,
    CacheError,
    CacheNamespace,
    CacheToken,
    ImageToken,
    OutOfPages,
    SequenceCache,
)
from cache.integrity import check_sequence_cache

BOS = 1
PREFIXES = [[], list(range(100, 120)), [*range(100, 110), *range(200, 230)], [7] * 24]
NAMESPACES = [CacheNamespace(), CacheNamespace(tenant="acme"), CacheNamespace(adapter="lora")]
IMAGES = [ImageToken(0xA11CE, 12), ImageToken(0xB0B, 20)]
STEPS = {"count": 0}


@dataclass
class Running:
    seq: CachedSequence
    tokens: list[CacheToken]
    done: int
    """Positions whose KV the simulated forward pass has written."""


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 120
    block_size = 4

    def __init__(self) -> None:
        super().__init__()
        config = CacheConfig(self.num_pages, self.page_size, 6, self.block_size)
        self.cache = SequenceCache(config, source="machine")
        self.index = BlockSetIndex("machine")
        self.cache.events.subscribe(self.index.apply)
        self.running: list[Running] = []
        self.history: list[tuple[list[CacheToken], CacheNamespace]] = []

    # -- starting ------------------------------------------------------------------------------
    def _start(self, tokens: list[CacheToken], ns: CacheNamespace, reserve: int) -> None:
        before = (self.cache.pool.num_free, self.cache.tree.cached_pages, len(self.running))
        try:
            seq = self.cache.start(tokens, ns, reserve=reserve)
        except CacheError:
            assert before == (
                self.cache.pool.num_free,
                self.cache.tree.cached_pages,
                len(self.running),
            ), "a refused start changed the pool"
            return
        self.cache.take_page_copies(seq)  # the worker copies, then computes from `reused`
        self.running.append(Running(seq, tokens, seq.reused))

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 5), max_size=14),
        ns=st.sampled_from(NAMESPACES),
        image=st.sampled_from([None, *IMAGES]),
        reserve=st.integers(0, 40),
    )
    def start_new(
        self,
        prefix: list[int],
        tail: list[int],
        ns: CacheNamespace,
        image: ImageToken | None,
        reserve: int,
    ) -> None:
        tokens: list[CacheToken] = [BOS, *([image] if image else []), *prefix, *tail]
        self._start(tokens, ns, reserve)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def start_duplicate_of_running(self, pick: int) -> None:
        run = self.running[pick % len(self.running)]
        self._start(list(run.tokens), run.seq.namespace, 0)

    @precondition(lambda self: self.history)
    @rule(pick=st.integers(0, 1000), extend=st.lists(st.integers(0, 5), max_size=3))
    def start_again(self, pick: int, extend: list[int]) -> None:
        tokens, ns = self.history[pick % len(self.history)]
        self._start([*tokens, *extend], ns, 0)

    # -- running -------------------------------------------------------------------------------
    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), chunk=st.integers(1, 24), commit=st.booleans())
    def compute(self, pick: int, chunk: int, commit: bool) -> None:
        run = self.running[pick % len(self.running)]
        mapped = len(self.cache.table.row(run.seq.slot)) * self.page_size
        run.done = min(run.done + chunk, len(run.seq.keys), mapped)
        if commit or run.done == run.seq.prompt_length:
            self.cache.commit(run.seq, run.done)

    @precondition(lambda self: any(r.done == len(r.seq.keys) for r in self.running))
    @rule(pick=st.integers(0, 100), token=st.integers(0, 5))
    def sample(self, pick: int, token: int) -> None:
        ready = [r for r in self.running if r.done == len(r.seq.keys)]
        run = ready[pick % len(ready)]
        self.cache.append(run.seq, [token])
        run.tokens.append(token)
        rows_before = len(self.cache.table.row(run.seq.slot))
        try:
            self.cache.grow(run.seq, len(run.seq.keys))
        except OutOfPages:  # the engine would preempt this sequence
            assert len(self.cache.table.row(run.seq.slot)) == rows_before
            self._end(run, finish=True)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def fork(self, pick: int) -> None:
        run = self.running[pick % len(self.running)]
        try:
            clone = self.cache.fork(run.seq)
        except CacheError:
            return
        self.cache.take_page_copies(clone)
        self.running.append(Running(clone, list(run.tokens), clone.computed))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), finish=st.booleans())
    def end(self, pick: int, finish: bool) -> None:
        self._end(self.running[pick % len(self.running)], finish)

    def _end(self, run: Running, finish: bool) -> None:
        if finish:
            self.cache.finish(run.seq, run.done)
            self.history.append((run.tokens[: run.seq.prompt_length], run.seq.namespace))
        else:
            self.cache.abort(run.seq)
        self.running.remove(run)

    @rule(pages=st.integers(0, 40))
    def evict(self, pages: int) -> None:
        evictable = self.cache.tree.evictable_pages
        freed = self.cache.tree.evict(pages)
        assert freed >= min(pages, evictable), (freed, pages, evictable)
        assert freed <= evictable

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def everything_accounted_for(self) -> None:
        STEPS["count"] += 1
        check_sequence_cache(self.cache)
        assert self.index.in_sync, "an event was lost"
        assert self.index.blocks == self.cache.tree.block_set(), "events disagree with the tree"


class BigPageMachine(CacheMachine):
    page_size = 16
    num_pages = 18
    block_size = 16


def _run(machine: type[CacheMachine], examples: int) -> int:
    STEPS["count"] = 0
    run_state_machine_as_test(
        machine, settings=settings(max_examples=examples, stateful_step_count=100, deadline=None)
    )
    return STEPS["count"]


def test_random_operations_page_size_1() -> None:
    assert _run(CacheMachine, 70) >= 5000


def test_random_operations_page_size_16() -> None:
    assert _run(BigPageMachine, 70) >= 5000
