"""SGLang router's cache-aware policy, as published (sgl-router `cache_aware`), for comparison.

    loads = requests in flight per worker
    imbalanced = max - min > balance_abs_threshold  and  max > balance_rel_threshold * min
    if imbalanced:   the least loaded worker
    else:            match = longest prefix of the prompt in the approximate tree
                     match / prompt > cache_threshold ? the matched worker
                                                     : the worker with the smallest tree
    either way the prompt is inserted into the tree for the chosen worker

Every `eviction_interval_s` the tree is cut to `max_tree_tokens` per worker (LRU leaves). The
defaults are sglang_router's `RouterArgs` (cache 0.3, abs 64, rel 1.5, 60 s, 2**26); the tree
counts tokens where SGLang's counts characters. It ignores KV events: its tree is a guess.
A baseline only: never the default, never tuned to win.
"""

from __future__ import annotations

import time

from router.approx_tree import ApproxTree
from router.base import BaseRouter, Clock
from router.config import RouterConfig
from router.interface import RouteDecision, RouteRequest, WorkerId


class SglangApproxTree(BaseRouter):
    name = "sglang"
    tracks_blocks = False

    def __init__(
        self,
        config: RouterConfig | None = None,
        clock: Clock = time.monotonic,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 60.0,
        max_tree_tokens: int = 2**26,
    ) -> None:
        super().__init__(config, clock)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_tokens = max_tree_tokens
        self.tree = ApproxTree(self.block_tokens)
        self._next_eviction: float | None = None

    def add_worker(self, worker: WorkerId, capacity_tokens: int) -> None:
        super().add_worker(worker, capacity_tokens)
        self.tree.add_tenant(worker)

    def remove_worker(self, worker: WorkerId) -> None:
        super().remove_worker(worker)
        self.tree.remove_tenant(worker)

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        self._maybe_evict(now)
        order, states = self.members.order, self.loads.workers
        loads = [states[w].running for w in order]
        low, high = min(loads), max(loads)
        hashes = request.block_hashes
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            worker = order[loads.index(low)]
            matched = 0
        else:
            depth, tenant = self.tree.match(hashes, now)
            matched = self.predicted_tokens(depth, request)
            if tenant is not None and matched > self.cache_threshold * request.num_tokens:
                worker = tenant
            else:
                worker, matched = self.tree.smallest_tenant(order), 0
        self.tree.insert(hashes, worker, now)
        return RouteDecision(worker, matched)

    def _maybe_evict(self, now: float) -> None:
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        elif now >= self._next_eviction:
            self.tree.evict(self.max_tree_tokens)
            self._next_eviction = now + self.eviction_interval_s

    def index_bytes(self) -> int:
        return self.tree.nbytes()
