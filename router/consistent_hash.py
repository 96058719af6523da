"""Consistent hashing: rendezvous hashing on the namespace and the prompt's leading blocks.

The key is the chained hash of block `key_blocks` (it digests the namespace and every block
before it), or of the last complete block of a shorter prompt, or of the namespace alone. Equal
leading blocks always meet on one worker; a hot prefix therefore makes a hot spot. Blind to load.
Must never use Python's `hash()` (salted per process): router/rendezvous.py.
"""

from __future__ import annotations

import time

from router.base import BaseRouter, Clock
from router.config import RouterConfig
from router.interface import RouteDecision, RouteRequest
from router.rendezvous import best, worker_seed


class ConsistentHash(BaseRouter):
    name = "consistent_hash"
    tracks_blocks = False

    def __init__(
        self, config: RouterConfig | None = None, clock: Clock = time.monotonic, key_blocks: int = 2
    ) -> None:
        super().__init__(config, clock)
        if key_blocks < 1:
            raise ValueError(f"key_blocks must be >= 1, got {key_blocks}")
        self.key_blocks = key_blocks

    def choose(self, request: RouteRequest, now: float) -> RouteDecision:
        hashes = request.block_hashes
        if hashes:
            key = hashes[min(self.key_blocks, len(hashes)) - 1]
        else:
            ns = request.namespace
            salted = "" if ns.salt is None else f"\x1f{ns.salt}"  # unsalted: the key it had
            key = worker_seed(f"{ns.adapter}\x1f{ns.tenant}\x1f{ns.image_hash}{salted}")
        seeds = self.members.seed
        return RouteDecision(best(key, ((seeds[w], w) for w in self.members.order)), 0)
