"""Sending this worker's cached KV to another worker (the `ReadKv` RPC).

The router sends a request to one worker and, when another's device holds more of its
prompt, names that one as the request's `kv_peer` (router/base.py `deeper_holder`). The reader
asks the holder for the positions past what it holds (worker/peer_reads.py); here the holder
answers:

    lease   (engine thread) match the prefix in the device tier, lock the node it ends in, and
            note its pages from `start` on: they can be neither evicted nor reused until `end`
    read    (engine thread, one chunk at a time between steps, the next while the last is
            serialised and sent) copy a chunk of whole pages of every layer to the CPU
    end     (engine thread) unlock

The chunks go out as safetensors bytes ("k", "v": [layers, pages, page_size, kv_heads,
head_dim]), serialised off the engine thread. A prefix is only ever matched under the
namespace the reader's engine resolved (tenant and adapter identity), and only sent when the
two workers' KV layouts (identity scheme, model revision, page and block size, dtype, shape)
are equal; a reader that goes away mid-stream ends the lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cache import CacheNamespace, Keys, Node
from cache.page_pool import PageIds
from cache.tiers import DEVICE
from protos.radixmesh.v1 import worker_pb2
from worker.kv_persistence import StoreIdentity

if TYPE_CHECKING:
    from worker.engine import Engine

CHUNK_BYTES = 16 << 20
"""About this much KV a message, and a copy on the engine thread (a few milliseconds of a CPU
worker's engine thread; the next chunk is copied while this one is serialised and sent). A busy
holder makes one copy a step, so this bounds what a read moves a step."""
MAX_READS = 8
"""Reads of this worker's KV under way at once; more are refused (RESOURCE_EXHAUSTED: the
reader recomputes), so that readers cannot hold much of the pool locked."""


def layout_to_proto(identity: StoreIdentity) -> worker_pb2.KvLayout:
    return worker_pb2.KvLayout(
        identity_version=identity.scheme_version,
        model_revision=identity.model_revision,
        page_size=identity.page_size,
        block_size=identity.block_size,
        dtype=identity.dtype,
        num_layers=identity.num_layers,
        kv_heads=identity.kv_heads,
        head_dim=identity.head_dim,
    )


def layout_from_proto(layout: worker_pb2.KvLayout) -> StoreIdentity:
    return StoreIdentity(
        layout.identity_version,
        layout.model_revision,
        layout.page_size,
        layout.block_size,
        layout.dtype,
        layout.num_layers,
        layout.kv_heads,
        layout.head_dim,
    )


@dataclass(slots=True)
class Lease:
    """Pages of a cached prefix held for a reader: from position `start` on, `pages`."""

    node: Node
    pages: PageIds
    start: int


def lease(engine: Engine, keys: Keys, namespace: CacheNamespace, start: int) -> Lease | None:
    """Lock the device-tier prefix of `keys` past `start` (engine thread); None when the
    device holds no whole page past `start`."""
    ps = engine.config.page_size
    match = engine.cache.tree.match(keys, namespace)
    end = match.length // ps * ps
    if end <= start or match.last_node is None:
        return None
    engine.cache.tree.lock(match.last_node)
    return Lease(match.last_node, match.pages[start // ps : end // ps], start)


def chunk_pages(engine: Engine) -> int:
    """Pages a chunk carries: CHUNK_BYTES of K and V, at least one page."""
    k = engine.runner.kv[0][0]
    page_bytes = 2 * len(engine.runner.kv) * k[0].numel() * k.element_size()
    return max(1, CHUNK_BYTES // page_bytes)


def read(engine: Engine, held: Lease, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the lease's pages [first, end), on the CPU (engine thread)."""
    return engine.runner.read_pages(DEVICE, held.pages[first:end])


def end(engine: Engine, held: Lease) -> None:
    """Let go of the lease's pages (engine thread)."""
    engine.cache.tree.unlock(held.node)
