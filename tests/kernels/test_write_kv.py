"""Triton write_kv against the reference: exactly the given slots change, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import reference, write_kv
from kernels.layout import PADDING_SLOT
from tests.kernels.helpers import fresh_seed, generator, randn


def poisoned_cache(
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    return torch.full(
        (num_pages, page_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device
    )


def assert_same(actual: torch.Tensor, expected: torch.Tensor, seed: int, what: str) -> None:
    same = (actual.cpu() == expected.cpu()) | (actual.cpu().isnan() & expected.cpu().isnan())
    assert bool(same.all()), (
        f"{what}: {int((~same).sum())} elements differ "
        f"(seed {seed}; replay with KERNEL_TEST_SEED={seed})"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("page_size", "kv_heads", "head_dim"), [(1, 2, 32), (16, 8, 64), (64, 3, 48)]
)
def test_write_kv_matches_reference(
    triton_device: torch.device, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    seed = fresh_seed()
    gen = generator(seed)
    num_pages = 12 if page_size > 1 else 300
    tokens = 37
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:5]] = PADDING_SLOT  # padding tokens: skipped
    k = randn(gen, tokens, kv_heads, head_dim, dtype=dtype, device=triton_device)
    v = randn(gen, tokens, kv_heads, head_dim, dtype=dtype, device=triton_device)
    caches = [
        poisoned_cache(num_pages, page_size, kv_heads, head_dim, dtype, triton_device)
        for _ in range(4)
    ]
    write_kv(caches[0], caches[1], k, v, slots.to(triton_device), backend="triton")
    reference.write_kv(caches[2], caches[3], k, v, slots.to(triton_device))
    assert_same(caches[0], caches[2], seed, "k_cache")
    assert_same(caches[1], caches[3], seed, "v_cache")
    written = int((~caches[0].isnan()).flatten(0, 1).any(-1).any(-1).sum())
    assert written == tokens - 5, (
        f"{written} slots written for {tokens - 5} real tokens (seed {seed})"
    )


def test_write_kv_from_fused_qkv_view(triton_device: torch.device) -> None:
    """k and v as strided views into one [tokens, q + 2 kv heads, head_dim] projection; int32
    slots."""
    seed = fresh_seed()
    gen = generator(seed)
    fused = randn(gen, 20, 4 + 2 + 2, 32, dtype=torch.float32, device=triton_device)
    k, v = fused[:, 4:6], fused[:, 6:8]
    slots = torch.randperm(4 * 16, generator=gen)[:20].to(triton_device, torch.int32)
    ours = [poisoned_cache(4, 16, 2, 32, torch.float32, triton_device) for _ in range(2)]
    theirs = [poisoned_cache(4, 16, 2, 32, torch.float32, triton_device) for _ in range(2)]
    write_kv(ours[0], ours[1], k, v, slots, backend="triton")
    reference.write_kv(theirs[0], theirs[1], k, v, slots)
    assert_same(ours[0], theirs[0], seed, "k_cache")
    assert_same(ours[1], theirs[1], seed, "v_cache")


def test_write_kv_with_no_tokens_is_a_no_op(triton_device: torch.device) -> None:
    caches = [poisoned_cache(2, 16, 1, 16, torch.float32, triton_device) for _ in range(2)]
    empty = torch.empty(0, 1, 16, device=triton_device)
    write_kv(
        caches[0],
        caches[1],
        empty,
        empty,
        torch.empty(0, dtype=torch.int64, device=triton_device),
        backend="triton",
    )
    assert bool(caches[0].isnan().all()) and bool(caches[1].isnan().all())
