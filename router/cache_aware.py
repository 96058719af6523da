"""cache_aware (draft for measurement)."""

from __future__ import annotations

import time

from router.base import BaseRouter, Clock
from router.config import RouterConfig
from router.interface import RouteDecision, RouteRequest
from router.prefix_match import prefix_groups
from router.rendezvous import weight


class CacheAware(BaseRouter):
    name = "cache_aware"

    def __init__(
        self,
        config: RouterConfig | None = None,
        clock: Clock = time.monotonic,
        work_weight: float = 1.0,
        epsilon: float = 1.0,
        slack_s: float = 4.0,
        ext_weight: float = 0.0,
        ext_m: int = 2,
        wait_scale: float = 0.0,
        block_cost: float = 0.0,
        tau: float = 0.4,
        tail_s: float = 1e9,
    ) -> None:
        self.block_cost = block_cost
        self.tau = tau
        self.tail_s = tail_s
        super().__init__(config, clock)
        self.work_weight = work_weight
        self.epsilon = epsilon
        self.slack_s = slack_s
        self.ext_weight = ext_weight
        self.ext_m = ext_m
        self.wait_scale = wait_scale

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        hashes = request.block_hashes
        groups = prefix_groups(hashes, self.index.holders, self.pending.holders)
        depth_of: dict[str, int] = {}
        for mask, depth in groups:
            for worker in self.members.workers_in(mask):
                depth_of[worker] = depth
        deepest = groups[-1][1] if groups else 0
        key = hashes[min(deepest, len(hashes) - 1)] if hashes else 0
        rate, n = self.prefill_rate, request.num_tokens
        states, seeds = self.loads.workers, self.members.seed
        order = self.members.order
        waits = {w: max(0.0, states[w].free_at - now) for w in order}
        mean_wait = sum(waits.values()) / len(order)
        bound = (1 + self.epsilon) * mean_wait + self.slack_s
        cached_of = {w: self.predicted_tokens(depth_of.get(w, 0), request) for w in order}
        max_cached = max(cached_of.values())
        S = sorted(waits.values())
        m = min(self.ext_m, len(S) - 1)
        before = sum(S[:m])
        best = None
        for worker in order:
            b = waits[worker]
            if b > bound:
                continue
            cached = cached_of[worker]
            d = (n - cached) / rate
            ext = 0.0
            if self.ext_weight and m > 0:
                T = list(S)
                T.remove(b)
                nb = b + d
                after = sum(T[: m - 1]) + nb if nb <= T[m - 1] else sum(T[:m])
                ext = after - before
            if self.block_cost and b <= self.tau < b + d and d < self.tail_s:
                ext_b = self.block_cost
            else:
                ext_b = 0.0
            wait_cost = b
            if self.wait_scale and d < self.tail_s:
                wait_cost = b * self.wait_scale / (self.wait_scale + d)
            cost = wait_cost + d + self.work_weight * (max_cached - cached) / rate + self.ext_weight * ext + ext_b
            entry = (cost, -weight(key, seeds[worker]), worker, cached)
            if best is None or entry < best:
                best = entry
        assert best is not None
        return RouteDecision(best[2], best[3])
