"""Long random runs of the sequence protocol, with every invariant checked after every step.

The machine plays an engine: it starts prompts (shared prefixes, several namespaces, images,
exact duplicates of running prompts, repeats of finished ones for full hits), computes KV in
chunks, commits, samples, grows, forks, finishes, aborts, evicts and drops whole namespaces (an
unloaded adapter's), on a pool small enough that eviction and refusals happen all the time.
After each step: page conservation with no page in two states, exact lock counts, every cached
node reachable and filed correctly, and the KV events replayed into a fresh index equal to the
tree's own block set.

The machine also keeps what every page would hold (the key and position of each slot): the
simulated forward pass writes a sequence's pages, and every copy the cache hands out (page
copies, tier copies) is performed in the order given, before the next forward pass as the worker
does. A sequence must then read exactly its own keys from the pages it reuses, and every cached
node's pages must hold its keys, in whichever tier they live.

Vision prompts are laid out as the Idefics3 / SmolVLM family lays them (worker/image_prompt.py):
per tile a wrapper token, a row tag and one ImageToken of the family's KV length (4: the tiny
test checkpoint; 64: SmolVLM-256M / 500M; 81: SmolVLM-2.2B), the global image last. The same
image recurs (in other namespaces too) and prefixes end inside images (chunks and commits stop
anywhere, eviction cuts anywhere). Every slot the simulation writes records the namespace of the
sequence that wrote it, so a sequence reading a page another tenant's sequence wrote, for the
same image, fails.

The tiered machines add a host tier smaller than what is evicted, so demotions, promotions, host
evictions, inserts over host-resident positions and aborts right after a promotion (before its
copies are taken) all happen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
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
    PageCopy,
    SequenceCache,
)
from cache.integrity import check_sequence_cache
from cache.radix_node import Node
from cache.tiers import DEVICE, QueuedCopy, SpillCopy, TierCopy
from cache.tokens import IMAGE

BOS = 1
PREFIXES = [[], list(range(100, 120)), [*range(100, 110), *range(200, 230)], [7] * 24]
NAMESPACES = [CacheNamespace(), CacheNamespace(tenant="acme"), CacheNamespace(adapter="lora")]
IMAGES = [ImageToken(0xA11CE, 12), ImageToken(0xB0B, 20)]
FAMILY_LENGTHS = (4, 64, 81)
"""`image_seq_len` of the Idefics3 family: the tiny checkpoint, SmolVLM-256M/500M, -2.2B."""
FAKE, GLOBAL, ROW = 501, 502, 510
"""The wrapper token, the global image's tag and the first row tag of a vision prompt."""
STEPS = {"count": 0, "drafts": 0}
MOVED = {
    "demoted": 0, "promoted": 0, "adopted": 0, "host_evicted": 0, "host_reads": 0, "spilled": 0
}  # fmt: skip
"""Pages moved between tiers (and spilled: read for a disk tier as eviction dropped them) over
a whole run (the tiered tests require each kind)."""
REUSED = {"image": 0, "inside_image": 0}
"""Starts whose reused prefix covered image positions, and those whose prefix ended inside an
image (the worker then recomputes the rest of it from the image's embeddings)."""


@dataclass
class Running:
    seq: CachedSequence
    tokens: list[CacheToken]
    done: int
    """Positions whose KV the simulated forward pass has written."""


def _namespace_of(node: Node) -> CacheNamespace | None:
    root = node
    while root.parent is not None:
        root = root.parent
    return root.namespace


def _whole_path(node: Node) -> list[tuple[Node, object]]:
    """A spill of `node` and every ancestor (a disk tier writes the unsaved ones): each
    `SpillCopy` then reads a cached node's pages too, not only the dropped one's."""
    ns, kept = _namespace_of(node), []
    while node.parent is not None:
        kept.append((node, (ns, list(node.keys), node.start)))
        node = node.parent
    return kept


Slot = tuple[CacheNamespace | None, int, int] | None
"""What one KV slot holds in the simulation: (namespace, key, position) of the sequence that
wrote it, or None if never written."""


def _is_image(key: int) -> bool:
    return key >> 61 == 0b100 | IMAGE


def tile_token(image: int, tile: int, length: int) -> ImageToken:
    """One tile's run of an image (its content hash names the image and the tile, as
    worker.image_prompt.tile_hash does)."""
    return ImageToken((0x1DEF1C5 << 64) | image << 16 | tile, length)


def vision_prompt(image: int, tiles: int, length: int) -> list[CacheToken]:
    """The image's part of a prompt: each grid tile, then the global image."""
    tokens: list[CacheToken] = []
    for tile in range(tiles - 1):
        tokens += [FAKE, ROW + tile, tile_token(image, tile, length)]
    return [*tokens, FAKE, GLOBAL, tile_token(image, tiles - 1, length), FAKE]


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 120
    block_size = 4
    host_pages = 0
    spill = False
    """Whether eviction offers what it drops (`on_drop`) and the machine takes all of it: each
    `SpillCopy` must then read exactly the dropped node's KV."""

    def __init__(self) -> None:
        super().__init__()
        config = CacheConfig(
            self.num_pages, self.page_size, 6, self.block_size, host_pages=self.host_pages
        )
        self.cache = SequenceCache(config, source="machine")
        if self.spill:
            self.cache.tree.on_drop = _whole_path
        self.index = BlockSetIndex("machine")
        self.cache.events.subscribe(self.index.apply)
        self.running: list[Running] = []
        self.history: list[tuple[list[CacheToken], CacheNamespace]] = []
        self.kv: dict[tuple[int, int], list[Slot]] = {}
        """(tier, page) -> its slots, as the worker's KV tensors would hold them."""
        self.seen: dict[str, int] = {}

    # -- the simulated KV ----------------------------------------------------------------------
    def _page(self, tier: int, page: int) -> list[Slot]:
        return self.kv.setdefault((tier, page), [None] * self.page_size)

    def _perform(self, copies: list[QueuedCopy | PageCopy]) -> None:
        ps = self.page_size
        for copy in copies:
            if isinstance(copy, TierCopy):
                for src, dst in zip(copy.src_pages, copy.dst_pages, strict=True):
                    self.kv[(copy.dst_tier, dst)] = list(self._page(copy.src_tier, src))
            elif isinstance(copy, SpillCopy):  # read before anything reuses the pages
                ns, keys, start = copy.token  # type: ignore[misc]
                assert len(copy.pages) * ps == len(keys), "a spill reads whole pages of a node"
                for j, key in enumerate(keys):
                    got = self._page(copy.tier, copy.pages[j // ps])[j % ps]
                    assert got == (ns, key, start + j), f"spilled {start + j}: {got}, not {key}"
            else:
                head = self._page(DEVICE, copy.src)[: copy.num_slots]
                self._page(DEVICE, copy.dst)[: copy.num_slots] = head

    def _flush(self) -> None:
        """What the worker does before each forward pass."""
        self._perform(list(self.cache.take_tier_copies()))

    def _assert_reads(self, seq: CachedSequence, upto: int) -> None:
        row, ps = self.cache.table.row(seq.slot), self.page_size
        for p in range(upto):
            got = self._page(DEVICE, row[p // ps])[p % ps]
            want = (seq.namespace, seq.keys[p], p)
            assert got == want, f"position {p} reads {got}, not {want}"

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
        self._perform(self.cache.take_page_copies(seq))  # then it computes from `reused`
        self._assert_reads(seq, seq.reused)
        reused = seq.keys[: seq.reused]
        if any(_is_image(k) for k in reused):
            REUSED["image"] += 1
        if 0 < seq.reused < len(seq.keys) and _is_image(seq.keys[seq.reused]):
            REUSED["inside_image"] += _is_image(reused[-1])
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

    @rule(
        prefix=st.sampled_from(PREFIXES),
        image=st.integers(0, 2),
        tiles=st.sampled_from([1, 3, 5]),
        length=st.sampled_from(FAMILY_LENGTHS),
        tail=st.lists(st.integers(0, 5), max_size=6),
        ns=st.sampled_from(NAMESPACES),
        reserve=st.integers(0, 40),
    )
    def start_vision_prompt(
        self,
        prefix: list[int],
        image: int,
        tiles: int,
        length: int,
        tail: list[int],
        ns: CacheNamespace,
        reserve: int,
    ) -> None:
        """A prompt of this family with one image of 1, 3 or 5 tiles (as many as leave room
        for others in the pool)."""
        while tiles > 1 and tiles * length > self.num_pages * self.page_size // 2:
            tiles -= 2
        tokens: list[CacheToken] = [BOS, *prefix, *vision_prompt(image, tiles, length), *tail]
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
        row, ps = self.cache.table.row(run.seq.slot), self.page_size
        mapped = len(row) * ps
        self._flush()
        old, run.done = run.done, min(run.done + chunk, len(run.seq.keys), mapped)
        for p in range(old, run.done):  # the forward pass writes the KV of these positions
            self._page(DEVICE, row[p // ps])[p % ps] = (run.seq.namespace, run.seq.keys[p], p)
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

    @precondition(lambda self: any(len(r.seq.keys) - r.done == 1 for r in self.running))
    @rule(
        pick=st.integers(0, 100),
        draft=st.lists(st.integers(0, 5), min_size=1, max_size=6),
        kept=st.integers(0, 6),
        token=st.integers(0, 5),
    )
    def verify_draft(self, pick: int, draft: list[int], kept: int, token: int) -> None:
        """A speculative step (worker/speculation.py): the pending token and a draft computed
        together, the first `kept` draft tokens kept and one more token drawn, then the
        sequence trimmed to what it keeps. The rejected draft's slots hold keys no sequence
        has: a cached node must never read them."""
        ready = [r for r in self.running if len(r.seq.keys) - r.done == 1]
        run = ready[pick % len(ready)]
        seq, ps, start = run.seq, self.page_size, run.done
        try:
            self.cache.grow(seq, start + 1 + len(draft))
        except OutOfPages:
            return
        self._flush()
        row = self.cache.table.row(seq.slot)
        written = [seq.keys[start], *(1000 + t for t in draft)]  # a draft's keys: all wrong
        kept = min(kept, len(draft))
        for i, key in enumerate(written):
            p = start + i
            self._page(DEVICE, row[p // ps])[p % ps] = (seq.namespace, key, p)
        drawn = [1000 + t for t in draft[:kept]] + [token]  # kept ones equal their draw
        self.cache.append(seq, drawn)
        run.tokens.extend(drawn)
        run.done = start + 1 + kept
        grown = len(row)
        self.cache.trim(seq, run.done + 1)
        wanted = max(-(-(run.done + 1) // ps), seq.cached_pages)
        assert len(self.cache.table.row(seq.slot)) == min(grown, wanted)
        STEPS["drafts"] += 1

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def fork(self, pick: int) -> None:
        run = self.running[pick % len(self.running)]
        try:
            clone = self.cache.fork(run.seq)
        except CacheError:
            return
        self._perform(self.cache.take_page_copies(clone))
        self._assert_reads(clone, clone.computed)
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

    @rule()
    def evict_everything(self) -> None:
        """Everything unlocked leaves the device (to the host, when there is one)."""
        evictable = self.cache.tree.evictable_pages
        assert self.cache.tree.evict(evictable) == evictable
        assert self.cache.tree.evictable_pages == 0

    @rule(ns=st.sampled_from(NAMESPACES))
    def drop_namespace(self, ns: CacheNamespace) -> None:
        """An unloaded adapter's tree goes (on both tiers); refused while a sequence runs in it."""
        tree, pool = self.cache.tree, self.cache.pool
        before = (pool.num_free, tree.cached_pages, tree.host_cached_pages)
        if any(r.seq.namespace == ns for r in self.running):
            with pytest.raises(CacheError):
                self.cache.drop_namespaces({ns})
            assert before == (pool.num_free, tree.cached_pages, tree.host_cached_pages)
            return
        own = [n for n in tree.nodes() if _namespace_of(n) == ns]
        freed = self.cache.drop_namespaces({ns})
        assert ns not in tree.roots
        assert freed == sum(len(n.pages) for n in own if n.tier == DEVICE)
        assert pool.num_free == before[0] + freed

    @precondition(lambda self: self.history)
    @rule(pick=st.integers(0, 1000))
    def start_then_abort(self, pick: int) -> None:
        """A start (promoting, with a host tier) aborted before its copies were taken."""
        tokens, ns = self.history[pick % len(self.history)]
        try:
            seq = self.cache.start(tokens, ns)
        except CacheError:
            return
        self.cache.abort(seq)

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def everything_accounted_for(self) -> None:
        STEPS["count"] += 1
        tree = self.cache.tree
        for kind in ("demoted", "promoted", "adopted", "host_evicted", "spilled"):
            MOVED[kind] += getattr(tree, f"{kind}_pages") - self.seen.get(kind, 0)
            self.seen[kind] = getattr(tree, f"{kind}_pages")
        MOVED["host_reads"] += self.cache.stats.host_positions - self.seen.get("host_reads", 0)
        self.seen["host_reads"] = self.cache.stats.host_positions
        check_sequence_cache(self.cache)
        assert self.index.in_sync, "an event was lost"
        assert self.index.blocks == self.cache.tree.block_set(), "events disagree with the tree"
        assert self.index.host == self.cache.tree.host_block_set(), "events lost a tier move"

    @invariant()
    def cached_pages_hold_their_keys(self) -> None:
        self._flush()
        ps = self.page_size
        for node in self.cache.tree.nodes():
            ns = _namespace_of(node)
            for j, key in enumerate(node.keys):
                got = self._page(node.tier, node.pages[j // ps])[j % ps]
                want = (ns, key, node.start + j)
                assert got == want, f"{node!r} position {node.start + j}: {got}, not {want}"


class BigPageMachine(CacheMachine):
    page_size = 16
    num_pages = 18
    block_size = 16


class TieredMachine(CacheMachine):
    host_pages = 40
    spill = True


class TieredPage4Machine(CacheMachine):
    page_size = 4
    num_pages = 30
    block_size = 4
    host_pages = 12
    spill = True


class SpillingPage4Machine(CacheMachine):
    """No host tier: eviction drops device nodes whole (no trim in place) and spills them."""

    page_size = 4
    num_pages = 30
    block_size = 4
    spill = True


class TieredBigPageMachine(BigPageMachine):
    num_pages = 12
    host_pages = 8


def _run(machine: type[CacheMachine], examples: int) -> int:
    """Run `machine` for `examples` examples of up to 100 steps; returns the steps run. Not
    derandomized, though hypothesis's CI profile (CI=true) would: there every run draws the
    same examples, chosen by a digest of the machine's code, so a retry of `_run_until`
    would repeat the miss, and an edit of the machine could move every cell's coverage (the
    CI of the change that added the spilling machines drew no reuse inside an image at page
    1, three runs alike, where unseeded runs miss about one in five)."""
    STEPS.update(dict.fromkeys(STEPS, 0))
    MOVED.update(dict.fromkeys(MOVED, 0))
    REUSED.update(dict.fromkeys(REUSED, 0))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples, stateful_step_count=100, deadline=None, derandomize=False
        ),
    )
    return STEPS["count"]


def _reused_images() -> bool:
    """Also: a speculative draft was verified (`verify_draft`), which every run draws."""
    return bool(REUSED["image"] and REUSED["inside_image"] and STEPS["drafts"])


def test_random_operations_page_size_1() -> None:
    _run_until(CacheMachine, 90, _reused_images)


def test_random_operations_page_size_16() -> None:
    _run_until(BigPageMachine, 90, _reused_images)


def _moved_both_ways() -> bool:
    """Demotions, promotions and sequences reading promoted pages all happened. (Host
    evictions, inserts over host nodes and the rest happen in most runs; tests/cache/test_tiers.py
    covers each on purpose.)"""
    return bool(MOVED["demoted"] and MOVED["promoted"] and MOVED["host_reads"])


def _run_until(
    machine: type[CacheMachine], examples: int, happened: Callable[[], bool], runs: int = 6
) -> None:
    """`_run` until one run has drawn what `happened` asks for (at most `runs` runs): an
    unseeded run of 90 examples now and then draws no promotion at all (seen once in about 50
    runs of the page-4 machine), or no start whose reused prefix ends inside an image (about
    one run in five of the page-1 machine, one in twelve of the page-16 machine; three runs of
    the page-16 machine all missed in one fresh-clone CI run, hence six). A run that draws it
    ends the loop, so the extra runs cost time only when the first ones miss."""
    for _ in range(runs):
        assert _run(machine, examples) >= 5000
        if happened():
            return
    raise AssertionError(f"no run of {runs} drew it: {MOVED} {REUSED}")


def test_random_operations_with_a_host_tier_page_size_1() -> None:
    _run_until(TieredMachine, 90, _moved_both_ways)


def test_random_operations_with_a_host_tier_page_size_4() -> None:
    _run_until(TieredPage4Machine, 90, _moved_both_ways)


def test_random_operations_spilling_what_eviction_drops_page_size_4() -> None:
    """Without a host tier every eviction drops, whole nodes (no trim in place), and each
    `SpillCopy` must read the dropped node's KV (the tiered machines spill what their host
    drops, less often). An unseeded run of 90 examples now and then draws no eviction that
    spills at all (once in the twenty-first session's fresh-clone CI, none in 18 runs here), so
    up to three runs, as for the tiered machines; no run may ever demote."""

    def spilled_and_never_demoted() -> bool:
        assert not MOVED["demoted"], MOVED  # no host tier: nothing has anywhere to go
        return bool(MOVED["spilled"])

    _run_until(SpillingPage4Machine, 90, spilled_and_never_demoted)


def test_random_operations_with_a_host_tier_page_size_16() -> None:
    # prompts here span one to four pages: moves happen in most runs, not in every one
    assert _run(TieredBigPageMachine, 90) >= 5000


def test_without_a_host_tier_nothing_moves_between_tiers() -> None:
    assert _run(CacheMachine, 5) > 0
    assert not any(MOVED.values()), MOVED
