"""Putting KV read from elsewhere (a saved file, another worker) into the cache.

`attach_kv` inserts one run of positions whose parent path is cached: it takes fresh device
pages, writes the KV into them and inserts them into the tree under the namespace, freeing any
the tree already held meanwhile. Engine thread only.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

from cache import CacheError, CacheNamespace

if TYPE_CHECKING:
    from worker.engine import Engine


def attach_kv(
    engine: Engine,
    namespace: CacheNamespace,
    prefix: array[int],
    keys: array[int],
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """Insert `keys` (its parent's path `prefix` is cached) with the K and V of its positions
    past `prefix` ([layers, pages, page_size, kv_heads, head_dim]). False when the parent is no
    longer cached or the pool has no room: nothing changed."""
    cache, runner, ps = engine.cache, engine.runner, engine.config.page_size
    parent = None
    before = array("i")
    if prefix:
        match = cache.tree.match(prefix, namespace)
        if match.host_node is not None:
            match = cache.tree.promote(match)
            runner.copy_pages(cache.take_tier_copies())
        if match.length != len(prefix):
            return False  # the parent was evicted meanwhile (a full pool)
        parent, before = match.last_node, match.pages
    cache.tree.lock(parent)
    try:
        try:
            fresh = cache.table.allocate_pages((len(keys) - len(prefix)) // ps)
        except CacheError:
            return False
        try:
            runner.copy_pages(cache.take_tier_copies())  # demotions read their pages first
            runner.write_pages(fresh, k, v)
        except BaseException:
            cache.pool.free_private(fresh)
            raise
        result = cache.tree.insert(keys, before + fresh, namespace, from_node=parent)
        # positions the tree already held (computed meanwhile): ours there are duplicates
        cache.pool.free_private(fresh[: len(result.existing_pages)])
    finally:
        cache.tree.unlock(parent)
    return True
