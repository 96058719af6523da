"""Builders for router tests: a settable clock, requests from token ids, real caches as workers.

The block hashes always come from `cache.BlockHasher`, and the events from a real
`cache.SequenceCache`, so the tests exercise the router against what a worker really publishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache import (
    DEFAULT_NAMESPACE,
    BlockHasher,
    CacheConfig,
    CacheNamespace,
    IdentityScheme,
    KvEvent,
    SequenceCache,
)
from router.config import RouterConfig
from router.interface import RouteRequest, RoutingPolicy

BLOCK = 4
"""Tokens per routing block in these tests."""
RATE = 1000.0
"""Prefill tokens per second in these tests: 1 token = 1 ms."""
CONFIG = RouterConfig(prefill_rate=RATE, block_tokens=BLOCK)
HASHER = BlockHasher(IdentityScheme(BLOCK, ""))


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def request(
    rid: str, tokens: list[int], namespace: CacheNamespace = DEFAULT_NAMESPACE
) -> RouteRequest:
    return RouteRequest(rid, namespace, tuple(HASHER.hashes(tokens, namespace)), len(tokens))


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    """`prefix` followed by distinct ids derived from `seed`, `length` tokens in all."""
    head = list(prefix or [])
    return head + [seed * 100_000 + i for i in range(length - len(head))]


@dataclass
class Worker:
    """A real cache whose events are collected for the router."""

    name: str
    capacity: int = 4096
    events: list[KvEvent] = field(default_factory=list)
    cache: SequenceCache = field(init=False)

    def __post_init__(self) -> None:
        config = CacheConfig(self.capacity + 1, 1, max_sequences=8, block_size=BLOCK)
        self.cache = SequenceCache(config, source=self.name)
        self.cache.events.subscribe(self.events.append)

    def serve(self, tokens: list[int], namespace: CacheNamespace = DEFAULT_NAMESPACE) -> int:
        """Prefill `tokens` and cache them; returns the tokens reused from the cache."""
        seq = self.cache.start(tokens, namespace)
        self.cache.take_page_copies(seq)
        self.cache.finish(seq, len(tokens))
        return seq.reused

    def deliver(self, policy: RoutingPolicy) -> None:
        """Hand every collected event to the policy, in order."""
        for event in self.events:
            assert policy.apply_event(self.name, event)
        self.events.clear()
