"""Sequence ownership: the whole protocol between a running sequence and the prefix cache.

The worker calls only this class; every rule of seed 000's `start_sequence` / `release_sequence`
lives here and is tested without a model:

    start   match the prompt, lock the match, map the reused pages, allocate the rest
    commit  the KV of positions [0, computed) is written: insert them, swap any duplicate pages
            for the tree's and free them, move the lock to the inserted node
    grow    map more private pages (decode, chunked prefill)
    trim    free the private pages past a length (a rejected draft's)
    fork    a clone for n > 1 sampling: shares the cached pages, copies the partial last page
    finish  offer what was computed (prompt and generated) to the cache, unlock, free the rest
    abort   unlock and free, caching nothing; valid at any point

`drop_namespaces` removes whole namespaces from the tree (an unloaded adapter's) once no live
sequence runs in them.

With a host tier (`CacheConfig.host_pages`), `start` promotes the host-resident part of its
match back to the device, and any allocation may demote evicted pages to the host. Those moves
queue `TierCopy`s (and `SpillCopy`s of what eviction drops, with the tree's `on_drop`);
`take_page_copies` hands them out ahead of the sequence's own copies and `take_tier_copies`
alone: the worker performs them in order before its next forward pass.

A sequence's page-table row always reads

    [ cached pages (tree-owned, locked) | private pages (this sequence's alone) ]
      0 ........................ cached_pages ..................... len(row)

and its positions, for the prompt at start:

    | reused (cache hit) | copied* | computed by prefill ... | decode ...
    0                 full*ps    reused                    prompt_length

*A page-aligned hit cannot cover the last prompt position (its logits are needed), and with
page_size > 1 the page holding it is shared; the reused part of that page is copied into a
private page (a `PageCopy` the worker performs before its next forward pass).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from cache.config import CacheConfig
from cache.errors import CacheError, SequenceError
from cache.events import KvEventPublisher
from cache.identity import BlockHasher, IdentityScheme
from cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from cache.page_pool import PagePool
from cache.page_table import PageTable
from cache.radix_cache import RadixCache
from cache.radix_node import MatchResult, Node
from cache.tiers import QueuedCopy
from cache.tokens import CacheToken, Keys, to_cache_keys


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy KV slots [0, num_slots) of page `src` into page `dst` (every layer, K and V)."""

    src: int
    dst: int
    num_slots: int


@dataclass(eq=False, slots=True)
class CachedSequence:
    slot: int
    """The page-table row of this sequence."""
    namespace: CacheNamespace
    keys: Keys
    """One key per position: the prompt, then each generated token once appended."""
    prompt_length: int
    reused: int
    """Prompt positions served from the cache at start: prefill computes from here."""
    computed: int
    """Positions whose KV is in this sequence's pages."""
    lock_node: Node | None = None
    cached_pages: int = 0
    """Leading pages of the row owned by the cache and protected by the lock on `lock_node`."""
    page_copies: list[PageCopy] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    released: bool = False
    host_reused: int = 0
    """Of `reused`, the positions `start` promoted from the host tier."""


@dataclass(slots=True)
class SequenceStats:
    started: int = 0
    prompt_positions: int = 0
    reused_positions: int = 0
    duplicate_pages_freed: int = 0
    given_blocks: int = 0
    """Block hashes taken as given (`start`'s `block_hashes`) instead of computed here."""
    host_positions: int = 0
    """Reused positions that `start` promoted from the host tier."""


def _pages_for(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


class SequenceCache:
    """Owns the pool, the tree and the page table of one worker, and the sequences on them."""

    def __init__(self, config: CacheConfig, source: str = "local") -> None:
        self.config = config
        self.page_size = config.page_size
        self.pool = PagePool(config.num_pages, config.page_size)
        self.host_pool = None
        if config.host_pages:
            self.host_pool = PagePool(config.host_pages, config.page_size)
        self.scheme = IdentityScheme(config.block_size, config.model_revision)
        self.hasher = BlockHasher(self.scheme)
        self.events = KvEventPublisher(source)
        self.tree = RadixCache(self.pool, self.hasher, self.events, self.host_pool)
        self.table = PageTable(self.pool, config.max_sequences, evictor=self.tree)
        self.stats = SequenceStats()
        self._live: dict[int, CachedSequence] = {}

    @property
    def live(self) -> list[CachedSequence]:
        return list(self._live.values())

    def can_reserve(self, num_pages: int) -> bool:
        return self.table.can_reserve_with_eviction(num_pages)

    # -- start ---------------------------------------------------------------------------------
    def start(
        self,
        tokens: Iterable[CacheToken],
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        reserve: int = 0,
        block_hashes: Sequence[int] = (),
    ) -> CachedSequence:
        """Begin a sequence: reuse its cached prefix and hold pages for max(prompt, reserve).

        `block_hashes`, the chain of the leading blocks as another party computed it (the
        router, under the same identity scheme), saves hashing them again when it checks out
        (`BlockHasher.accepts`); otherwise it is ignored. Raises `OutOfPages` / `OutOfSlots` having
        changed nothing (beyond LRU order).
        """
        return self._start(to_cache_keys(tokens), namespace, reserve, block_hashes)

    def start_keys(
        self,
        keys: Keys,
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
        reserve: int = 0,
        block_hashes: Sequence[int] = (),
        *,
        text: bool = False,
        reuse: bool = True,
    ) -> CachedSequence:
        """`start` from keys made earlier by `to_cache_keys` (the worker makes a prompt's keys
        once, on the thread that submits it, so its engine thread converts nothing). The
        sequence keeps a copy: it extends its keys as tokens are generated. Raises `TypeError`
        for anything but an `array("Q")` (tokens go to `start`, which checks them).

        `text`: every key was made from a token id (no image), so `block_hashes` is checked
        without a scan for typed keys (`BlockHasher.accepts`). `reuse=False`: nothing cached
        is reused, every position is computed (a request that scores its whole prompt); its
        pages are cached at commit as any sequence's, duplicates of cached ones freed."""
        if type(keys) is not array or keys.typecode != "Q":
            raise TypeError(
                f"start_keys takes the array('Q') to_cache_keys makes, got {type(keys).__name__}; "
                "give tokens to start"
            )
        return self._start(array("Q", keys), namespace, reserve, block_hashes, text, reuse)

    def _start(
        self,
        keys: Keys,
        namespace: CacheNamespace,
        reserve: int,
        block_hashes: Sequence[int],
        text: bool = False,
        cached: bool = True,
    ) -> CachedSequence:
        n, ps = len(keys), self.page_size
        if n == 0:
            raise SequenceError("empty prompt: a sequence needs at least one position")
        match = self.tree.match(keys, namespace) if cached else MatchResult()
        on_device = match.length
        if match.host_node is not None and on_device < n - 1 and self.table.num_free_slots:
            # promote only if the whole start then fits: a refused start changes nothing
            reused_pages = min(on_device + match.host_length, n - 1) // ps
            match = self.tree.promote(match, _pages_for(max(n, reserve), ps) - reused_pages)
        reuse = min(match.length, n - 1)
        full = reuse // ps
        node = match.last_node
        self.tree.lock(node)
        slot = None
        try:
            slot = self.table.allocate()
            self.table.map_pages(slot, 0, match.pages[:full], validate=False)
            fresh = self.table.allocate_pages(_pages_for(max(n, reserve), ps) - full)
            self.table.map_pages(slot, full, fresh, validate=False)
        except CacheError:
            if slot is not None:
                self.table.erase(slot, full)
            self.tree.unlock(node)
            raise
        copies = []
        if reuse > full * ps:
            copies.append(PageCopy(match.pages[full], fresh[0], reuse - full * ps))
        chain = match.block_hashes
        if len(block_hashes) > len(chain) and self.hasher.accepts(
            block_hashes, keys, namespace, text=text
        ):
            chain = list(block_hashes)
            self.stats.given_blocks += len(chain)
        seq = CachedSequence(slot, namespace, keys, n, reuse, reuse, node, full, copies, chain)
        seq.host_reused = max(0, reuse - on_device)
        self._live[slot] = seq
        self.stats.started += 1
        self.stats.prompt_positions += n
        self.stats.reused_positions += reuse
        self.stats.host_positions += seq.host_reused
        return seq

    def take_page_copies(self, seq: CachedSequence) -> list[QueuedCopy | PageCopy]:
        """The copies the worker must perform, in order, before computing this sequence's KV:
        every tier copy queued so far, then the sequence's own."""
        copies: list[QueuedCopy | PageCopy] = []
        copies.extend(self.tree.take_copies())
        copies.extend(seq.page_copies)
        seq.page_copies = []
        return copies

    def take_tier_copies(self) -> list[QueuedCopy]:
        """The tier copies queued so far (demotions by `grow`, `fork`, ...), in order."""
        return self.tree.take_copies()

    # -- while running -------------------------------------------------------------------------
    def append(self, seq: CachedSequence, tokens: Iterable[CacheToken]) -> None:
        """Extend the sequence's keys by generated tokens (their KV comes later)."""
        self._require_live(seq)
        seq.keys.extend(to_cache_keys(tokens))

    def grow(self, seq: CachedSequence, positions: int) -> None:
        """Make sure the row holds pages for `positions` positions (may evict; may raise)."""
        self._require_live(seq)
        have = len(self.table.row(seq.slot))
        need = _pages_for(positions, self.page_size) - have
        if need > 0:
            self.table.map_pages(seq.slot, have, self.table.allocate_pages(need), validate=False)

    def trim(self, seq: CachedSequence, positions: int) -> int:
        """Free the private pages past those `positions` positions need (pages a sequence grew
        for positions it did not keep, such as a rejected speculative draft's); never the
        cached pages nor a computed position's. Returns the pages freed."""
        self._require_live(seq)
        keep = max(_pages_for(max(positions, seq.computed), self.page_size), seq.cached_pages)
        return self.table.truncate(seq.slot, keep)

    def commit(self, seq: CachedSequence, computed: int) -> int:
        """Record that the KV of positions [0, computed) is written and cache its whole pages.

        Returns the pages the cache newly claimed from this sequence.
        """
        self._require_live(seq)
        ps = self.page_size
        if seq.page_copies:
            raise SequenceError("commit before the sequence's page copies were taken")
        mapped = len(self.table.row(seq.slot)) * ps
        if not seq.computed <= computed <= min(len(seq.keys), mapped):
            raise SequenceError(
                f"computed={computed} must lie in [{seq.computed}, "
                f"{min(len(seq.keys), mapped)}] (keys {len(seq.keys)}, mapped positions {mapped})"
            )
        seq.computed = computed
        target = computed - computed % ps
        cached_positions = seq.cached_pages * ps
        if target <= cached_positions:
            return 0
        anchor = seq.lock_node
        while anchor is not None and anchor.end > cached_positions:
            anchor = anchor.parent
        if anchor is not None and anchor.is_root():
            anchor = None
        result = self.tree.insert(
            seq.keys[:target],
            self.table.get_pages(seq.slot, 0, target // ps),
            seq.namespace,
            from_node=anchor,
            block_hashes=seq.block_hashes,
        )
        if result.existing_pages:
            first = anchor.end // ps if anchor is not None else 0
            old = self.table.replace_pages(seq.slot, first, result.existing_pages)
            duplicates = [
                p for p, tree_page in zip(old, result.existing_pages, strict=True) if p != tree_page
            ]
            self.pool.free_private(duplicates)
            self.stats.duplicate_pages_freed += len(duplicates)
        if result.node is not seq.lock_node:
            self.tree.lock(result.node)
            self.tree.unlock(seq.lock_node)
            seq.lock_node = result.node
        seq.cached_pages = result.node.end // ps
        return result.inserted_pages

    def fork(self, seq: CachedSequence) -> CachedSequence:
        """A clone of `seq` (n > 1 sampling) sharing its cached pages.

        The computed whole pages are committed first, so the clone shares them through the
        cache; a partial last page is copied (a `PageCopy` on the clone).
        """
        self._require_live(seq)
        self.commit(seq, seq.computed)
        ps, row = self.page_size, list(self.table.row(seq.slot))
        shared = seq.cached_pages
        self.tree.lock(seq.lock_node)
        slot = None
        try:
            slot = self.table.allocate()
            self.table.map_pages(slot, 0, row[:shared], validate=False)
            fresh = self.table.allocate_pages(len(row) - shared)
            self.table.map_pages(slot, shared, fresh, validate=False)
        except CacheError:
            if slot is not None:
                self.table.erase(slot, shared)
            self.tree.unlock(seq.lock_node)
            raise
        copies = [
            PageCopy(row[i], fresh[i - shared], min(ps, seq.computed - i * ps))
            for i in range(shared, _pages_for(seq.computed, ps))
        ]
        clone = CachedSequence(
            slot,
            seq.namespace,
            seq.keys[:],
            seq.prompt_length,
            seq.reused,
            seq.computed,
            seq.lock_node,
            shared,
            copies,
            list(seq.block_hashes),
        )
        self._live[slot] = clone
        return clone

    # -- whole namespaces ----------------------------------------------------------------------
    def drop_namespaces(
        self, which: Callable[[CacheNamespace], bool] | AbstractSet[CacheNamespace]
    ) -> int:
        """Drop every cached page of the namespaces `which` selects (`RadixCache.drop_namespaces`);
        returns the device pages freed. Raises `CacheError`, changing nothing, while a live
        sequence runs in one of them (it would cache its KV there again, or holds a lock)."""
        select = which.__contains__ if isinstance(which, AbstractSet) else which
        running = sorted({str(s.namespace) for s in self._live.values() if select(s.namespace)})
        if running:
            raise CacheError(f"cannot drop namespaces with live sequences: {', '.join(running)}")
        return self.tree.drop_namespaces(select)

    # -- end -----------------------------------------------------------------------------------
    def finish(self, seq: CachedSequence, computed: int | None = None) -> None:
        """Cache what was computed (prompt and generated tokens), unlock, free the rest."""
        self._require_live(seq)
        if not seq.page_copies:
            self.commit(seq, seq.computed if computed is None else computed)
        self._release(seq)

    def abort(self, seq: CachedSequence) -> None:
        """Unlock and free everything private; caches nothing. Valid at any point."""
        self._require_live(seq)
        self._release(seq)

    def _release(self, seq: CachedSequence) -> None:
        self.tree.unlock(seq.lock_node)
        self.table.erase(seq.slot, seq.cached_pages)
        seq.lock_node = None
        seq.released = True
        seq.page_copies = []
        del self._live[seq.slot]

    def _require_live(self, seq: CachedSequence) -> None:
        if seq.released or self._live.get(seq.slot) is not seq:
            raise SequenceError(f"sequence in slot {seq.slot} was already released")
