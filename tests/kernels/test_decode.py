"""Triton split-K decode attention against the float64 reference, on poisoned paged batches.

Lengths include 1, block edges and sequences shorter than their split count (empty splits), with
one split, several, and the launcher's own choice.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import decode_attention, reference
from kernels.triton_decode import BLOCK_N, MAX_SPLITS, choose_num_splits
from tests.kernels.helpers import PagedBatch, assert_close, fresh_seed, make_batch, poisoned_like


def decode_batch(
    seed: int, page_size: int, group: int, dtype: torch.dtype, device: torch.device
) -> PagedBatch:
    rng = random.Random(seed)
    k_lens = [1, rng.randint(2, 63), BLOCK_N, rng.randint(BLOCK_N + 1, 260), rng.randint(2, 200)]
    return make_batch(
        seed, [1] * len(k_lens), k_lens, page_size=page_size, kv_heads=2, group=group,
        head_dim=32, dtype=dtype, device=device,
    )  # fmt: skip


def oracle(batch: PagedBatch) -> torch.Tensor:
    b = batch.as_float64()
    return reference.decode_attention(b.q, b.k_cache, b.v_cache, b.page_table, b.seq_lens_k)


def run_split(batch: PagedBatch, num_splits: int) -> torch.Tensor:
    from kernels.triton_decode import decode_attention_split

    out = poisoned_like(batch.q)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens_k)
    result = decode_attention_split(*args, num_splits=num_splits, out=out)
    assert result is out, "decode_attention_split must write into and return `out`"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_matches_reference(
    triton_device: torch.device, page_size: int, group: int, dtype: torch.dtype
) -> None:
    seed = fresh_seed()
    batch = decode_batch(seed, page_size, group, dtype, triton_device)
    expected = oracle(batch)
    for splits in (1, 3):
        detail = (
            f"page_size={page_size} group={group} splits={splits} k={batch.seq_lens_k.tolist()}"
        )
        assert_close(run_split(batch, splits), expected, seed, "decode", detail)


def test_many_splits_most_empty(triton_device: torch.device) -> None:
    """More splits than blocks: most programs find an empty range and must not spoil the merge."""
    seed = fresh_seed()
    batch = decode_batch(seed, 16, 4, torch.float32, triton_device)
    assert_close(run_split(batch, 16), oracle(batch), seed, "decode", "splits=16")


def test_dispatch_picks_splits_itself(triton_device: torch.device) -> None:
    seed = fresh_seed()
    batch = decode_batch(seed, 16, 3, torch.float16, triton_device)
    out = poisoned_like(batch.q)
    decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens_k,
        out=out, backend="triton",
    )  # fmt: skip
    assert_close(out, oracle(batch), seed, "decode", "dispatch, group=3, fp16")


def test_num_splits_fill_the_device_but_stay_useful() -> None:
    cpu = torch.device("cpu")  # 4 pretend SMs on the CPU: 16 programs wanted
    assert choose_num_splits(batch=1, kv_heads=1, max_seq_len=32768, device=cpu) == 16
    assert choose_num_splits(batch=64, kv_heads=8, max_seq_len=8192, device=cpu) == 1
    assert choose_num_splits(batch=1, kv_heads=1, max_seq_len=300, device=cpu) == 2
    assert choose_num_splits(batch=1, kv_heads=1, max_seq_len=1 << 20, device=cpu) <= MAX_SPLITS


def test_long_contexts_split_unevenly(triton_device: torch.device) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    k_lens = [rng.randint(400, 1100) for _ in range(3)]
    batch = make_batch(
        seed, [1, 1, 1], k_lens, page_size=1, kv_heads=1, group=8, head_dim=64,
        dtype=torch.bfloat16, device=triton_device,
    )  # fmt: skip
    assert_close(run_split(batch, 5), oracle(batch), seed, "decode", f"splits=5 k={k_lens}")
