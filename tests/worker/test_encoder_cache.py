"""worker/encoder_cache.py: least recently used out, bounded in bytes, 0 keeps nothing."""

from __future__ import annotations

import pytest
import torch

from worker.encoder_cache import EncoderCache, tensor_bytes


def rows(n: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((n, 8), value, dtype=torch.float32)  # 32 bytes a row


def test_least_recently_used_goes_first_and_the_bytes_stay_bounded() -> None:
    cache = EncoderCache(max_bytes=10 * 32)
    cache.put("a", rows(4, 1.0))
    cache.put("b", rows(4, 2.0))
    assert cache.bytes == 8 * 32 and len(cache) == 2
    got = cache.get("a")  # now "b" is the least recently used
    assert got is not None and float(got[0, 0]) == 1.0
    assert cache.put("c", rows(4, 3.0))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.bytes == 8 * 32 <= cache.max_bytes
    assert cache.put("a", rows(2, 4.0))  # replacing an entry counts its new size only
    assert cache.bytes == 6 * 32
    entry = cache.get("a")
    assert entry is not None and tensor_bytes(entry) == 2 * 32


def test_an_output_over_the_budget_is_not_kept_and_evicts_nothing() -> None:
    cache = EncoderCache(max_bytes=4 * 32)
    cache.put("a", rows(3))
    assert not cache.put("huge", rows(5))
    assert "a" in cache and "huge" not in cache and cache.bytes == 3 * 32


def test_zero_bytes_keeps_nothing_and_negative_is_refused() -> None:
    cache = EncoderCache(0)
    assert not cache.put("a", rows(1)) and cache.get("a") is None and len(cache) == 0
    with pytest.raises(ValueError, match="encoder_cache_bytes"):
        EncoderCache(-1)
