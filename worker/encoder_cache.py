"""The vision encoder's outputs, kept by image so that an image whose KV is gone is not encoded
again: least recently used first out, bounded in bytes. Engine thread only.

An image's KV in the prefix cache makes its encoder output needless (a cached image is never
encoded). The output matters when that KV is gone (evicted) or partly there (a cached prefix
that ends inside the image, a sample preempted mid-prompt): then the rows still to compute come
from here instead of a second encoder run.

Entries are keyed by (tenant, image identity): as the KV cache salts every key with the tenant,
one tenant's request never learns from its latency that another tenant sent the same image.
`max_bytes` 0 keeps nothing; an output larger than the whole budget is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The output kept for `key` (now the most recently used), or None."""
        tensor = self._entries.get(key)
        if tensor is not None:
            self._entries.move_to_end(key)
        return tensor

    def put(self, key: Hashable, tensor: torch.Tensor) -> bool:
        """Keep `tensor` for `key`, dropping the least recently used to fit; False (nothing
        dropped) when it alone is over the budget."""
        size = tensor_bytes(tensor)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= tensor_bytes(old)
        while self.bytes + size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= tensor_bytes(dropped)
        self._entries[key] = tensor
        self.bytes += size
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
