"""Least own TTFT: the greedy baseline with the exact cache view.

Each worker's cost is this request's own time to first token there: the worker's queued prefill
work (seconds) plus this request's uncached tokens over the prefill rate, with cached tokens
read from the exact block index and pending routes. It ignores what the choice costs later
requests, which is where it loses (docs/router.md). A baseline for `cache_aware`.
"""

from __future__ import annotations

from router.base import BaseRouter
from router.interface import RouteDecision, RouteRequest
from router.prefix_match import prefix_groups
from router.rendezvous import weight


class LeastTtft(BaseRouter):
    name = "least_ttft"

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        hashes = request.block_hashes
        groups = prefix_groups(hashes, self.index.holders, self.pending.holders)
        depth_of: dict[str, int] = {}
        for mask, depth in groups:
            for worker in self.members.workers_in(mask):
                depth_of[worker] = depth
        deepest = groups[-1][1] if groups else 0
        key = hashes[min(deepest, len(hashes) - 1)] if hashes else 0
        rate, n, states, seeds = self.prefill_rate, request.num_tokens, self.loads.workers, self.members.seed
        best = None
        for worker in self.members.order:
            cached = self.predicted_tokens(depth_of.get(worker, 0), request)
            cost = max(0.0, states[worker].free_at - now) + (n - cached) / rate
            entry = (cost, -weight(key, seeds[worker]), worker, cached)
            if best is None or entry < best:
                best = entry
        assert best is not None
        return RouteDecision(best[2], best[3])
