"""The router's configuration, shared by every policy: one frozen dataclass, validated once.

A policy's own knobs (thresholds, weights) are keyword arguments of its constructor, with the
published or measured defaults beside them. Must never be mutated after it is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOST_SPEEDUP = 10.0
"""Until a router has learned it, a token copied back from a host tier costs this many times
less than a recomputed one."""


DEFAULT_SWAP_S = 0.05
"""Seconds to bring a LoRA adapter into a worker's device slot until the worker has measured it
(a rank-16 adapter of a 7B model is ~40 MB: tens of milliseconds over PCIe)."""


DISK_SPEEDUP = 4.0
"""Until a router has learned it, a token read back from a worker's saved cache costs this many
times less than a recomputed one (a 2-core CPU with SmolLM2 measured about 30 times less; a
fast GPU prefill can make it more than one: the worker then recomputes, and the router prices
a disk hit at most as recomputing it)."""


def default_host_rate(prefill_rate: float) -> float:
    return HOST_SPEEDUP * prefill_rate


def default_disk_rate(prefill_rate: float) -> float:
    return DISK_SPEEDUP * prefill_rate


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill_rate: float = 8000.0
    """A worker's prefill speed in tokens/s: turns queued tokens into seconds of waiting."""
    block_tokens: int = 16
    """Tokens per routing block: the workers' `IdentityScheme.block_size`."""
    host_rate: float | None = None
    """Tokens per second a worker copies back from its host tier, until learned; None:
    `default_host_rate(prefill_rate)`."""
    disk_rate: float | None = None
    """Tokens per second a worker reads back from its saved cache, until learned; None:
    `default_disk_rate(prefill_rate)`."""
    peer_rate: float | None = None
    """Tokens per second a worker reads from another worker's device (`kv_peer`,
    worker/peer_reads.py), for cache_aware to price a move away from a prefix's holder as that
    read rather than a recompute; None: priced as a recompute (the reads still happen)."""
    peer_min_tokens: int = 256
    """The least a read must bring: what `router.peer_kv_min_tokens` names a peer for."""
    adapter_swap_s: float = DEFAULT_SWAP_S
    """Seconds a worker takes to bring an adapter into a slot, until it reports its own."""
    pending_ttl_s: float = 60.0
    """The longest an unconfirmed route counts as cached on its worker."""
    pending_grace_s: float = 1.0
    """How long after its prefill a route still counts, while its `stored` event travels."""

    def __post_init__(self) -> None:
        for name in ("host_rate", "disk_rate", "peer_rate"):
            rate = getattr(self, name)
            if rate is not None and not 0.0 < rate < math.inf:
                raise ValueError(f"{name} must be > 0 tokens/s and finite, got {rate}")
        if not 0.0 < self.prefill_rate < math.inf:  # NaN too: every cost would be NaN
            raise ValueError(
                f"prefill_rate must be > 0 tokens/s and finite, got {self.prefill_rate}"
            )
        if not 0.0 <= self.adapter_swap_s < math.inf:
            raise ValueError(f"adapter_swap_s must be >= 0 and finite, got {self.adapter_swap_s}")
        if self.peer_min_tokens < 1:
            raise ValueError(f"peer_min_tokens must be >= 1, got {self.peer_min_tokens}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not (self.pending_ttl_s > 0 and self.pending_grace_s >= 0):  # NaN: never expires
            raise ValueError(
                f"need pending_ttl_s > 0 and pending_grace_s >= 0, "
                f"got {self.pending_ttl_s}, {self.pending_grace_s}"
            )
