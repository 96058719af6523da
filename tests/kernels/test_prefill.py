"""Triton append-prefill attention against the float64 reference, on poisoned paged batches.

Each case is a fresh random ragged batch holding a query of length 1, a chunk that is the whole
sequence, and chunks over cached prefixes, with lengths on both sides of the KV block size.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import append_prefill_attention, reference
from tests.kernels.helpers import PagedBatch, assert_close, fresh_seed, make_batch, poisoned_like

PAGE_SIZES = (1, 16, 64)
GROUPS = (1, 4, 8)


def ragged_lengths(seed: int) -> tuple[list[int], list[int]]:
    """(q_lens, k_lens): q_len 1; q_len == k_len; a long prefix + chunk; a block-edge chunk."""
    rng = random.Random(seed)
    k_lens = [
        rng.randint(2, 150),
        rng.randint(8, 140),
        rng.randint(70, 200),
        rng.choice((64, 65, 128)),
    ]
    q_lens = [1, k_lens[1], rng.randint(4, 40), rng.randint(1, k_lens[3])]
    return q_lens, k_lens


def run_triton(batch: PagedBatch, regions: torch.Tensor | None = None) -> torch.Tensor:
    out = poisoned_like(batch.q)
    result = append_prefill_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.page_table,
        batch.cu_seqlens_q,
        batch.seq_lens_k,
        max_seqlen_q=max(batch.q_lens),
        image_regions=regions,
        out=out,
        backend="triton",
    )
    assert result is out, "append_prefill_attention must write into and return `out`"
    return out


def oracle(batch: PagedBatch, regions: torch.Tensor | None = None) -> torch.Tensor:
    b = batch.as_float64()
    return reference.append_prefill_attention(
        b.q, b.k_cache, b.v_cache, b.page_table, b.cu_seqlens_q, b.seq_lens_k,
        image_regions=None if regions is None else regions.cpu(),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_causal_matches_reference(
    triton_device: torch.device, page_size: int, group: int, dtype: torch.dtype
) -> None:
    seed = fresh_seed()
    q_lens, k_lens = ragged_lengths(seed)
    batch = make_batch(
        seed, q_lens, k_lens, page_size=page_size, kv_heads=2, group=group, head_dim=32,
        dtype=dtype, device=triton_device,
    )  # fmt: skip
    detail = f"page_size={page_size} group={group} q_lens={q_lens} k_lens={k_lens}"
    assert_close(run_triton(batch), oracle(batch), seed, "append_prefill", detail)


def image_regions(seed: int, q_lens: list[int], k_lens: list[int]) -> list[tuple[int, int, int]]:
    """A region at the start of the whole-sequence chunk, one in the middle of a chunk, one inside
    a cached prefix, and one straddling the start of a chunk."""
    rng = random.Random(seed ^ 0x5EED)
    whole = 1  # ragged_lengths: sequence 1's chunk is its whole sequence
    regions = [(whole, rng.randint(0, 1), rng.randint(5, k_lens[whole]))]
    offset = k_lens[2] - q_lens[2]  # sequence 2: a prefix of >= 30 positions, then its chunk
    start = rng.randint(offset, k_lens[2] - 3)
    regions.append((2, start, rng.randint(start + 2, k_lens[2])))
    regions.append((2, 1, rng.randint(2, offset)))
    offset3 = k_lens[3] - q_lens[3]
    if offset3 >= 2:
        regions.append((3, offset3 - 2, k_lens[3]))
    return regions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_image_regions_match_reference(
    triton_device: torch.device, page_size: int, dtype: torch.dtype
) -> None:
    seed = fresh_seed()
    q_lens, k_lens = ragged_lengths(seed)
    batch = make_batch(
        seed, q_lens, k_lens, page_size=page_size, kv_heads=2, group=4, head_dim=32,
        dtype=dtype, device=triton_device,
    )  # fmt: skip
    rows = image_regions(seed, q_lens, k_lens)
    regions = torch.tensor(rows, dtype=torch.int32, device=triton_device)
    causal = oracle(batch)
    expected = oracle(batch, regions)
    detail = f"page_size={page_size} regions={rows} q_lens={q_lens} k_lens={k_lens}"
    assert not torch.allclose(causal, expected), f"regions {rows} changed nothing (seed {seed})"
    assert_close(run_triton(batch, regions), expected, seed, "append_prefill+regions", detail)


@pytest.mark.parametrize(("head_dim", "group"), [(48, 3), (64, 2), (128, 1), (16, 4)])
def test_head_dims_and_odd_groups(triton_device: torch.device, head_dim: int, group: int) -> None:
    seed = fresh_seed()
    q_lens, k_lens = [3, 40], [90, 40]
    batch = make_batch(
        seed, q_lens, k_lens, page_size=16, kv_heads=1, group=group, head_dim=head_dim,
        dtype=torch.float16, device=triton_device,
    )  # fmt: skip
    assert_close(run_triton(batch), oracle(batch), seed, "append_prefill", f"head_dim={head_dim}")


def test_strided_query_from_fused_qkv(triton_device: torch.device) -> None:
    """q as a view into a fused [tokens, (q_heads + 2 kv_heads) * head_dim] projection."""
    seed = fresh_seed()
    batch = make_batch(
        seed, [5, 33], [70, 33], page_size=16, kv_heads=2, group=4, head_dim=32,
        dtype=torch.float32, device=triton_device,
    )  # fmt: skip
    fused = poisoned_like(torch.empty(batch.q.shape[0], 12, 32, device=triton_device))
    fused[:, :8] = batch.q
    strided = PagedBatch(**{**batch.__dict__, "q": fused[:, :8]})
    assert not strided.q.is_contiguous()
    assert_close(run_triton(strided), oracle(batch), seed, "append_prefill", "strided q")


def test_default_scale_and_explicit_scale(triton_device: torch.device) -> None:
    seed = fresh_seed()
    batch = make_batch(
        seed, [4, 9], [50, 9], page_size=16, kv_heads=1, group=2, head_dim=32,
        dtype=torch.float32, device=triton_device,
    )  # fmt: skip
    b = batch.as_float64()
    args = (b.q, b.k_cache, b.v_cache, b.page_table, b.cu_seqlens_q, b.seq_lens_k)
    sharp = reference.append_prefill_attention(*args, softmax_scale=0.7)
    got = append_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.cu_seqlens_q,
        batch.seq_lens_k, softmax_scale=0.7, backend="triton",
    )  # fmt: skip
    assert_close(got, sharp, seed, "append_prefill", "softmax_scale=0.7")
    default = reference.append_prefill_attention(*args)
    assert not torch.allclose(sharp, default), "the scale should matter"


@pytest.mark.parametrize("group", [1, 4])
def test_every_diagonal_offset_around_block_edges(triton_device: torch.device, group: int) -> None:
    """Short chunks whose diagonals land on every residue around the 64-key block edges: the
    border between the unmasked and the masked stage is exact."""
    seed = fresh_seed()
    k_lens = [*range(58, 71), *range(122, 134)]
    q_lens = [1 + k % 3 for k in k_lens]
    batch = make_batch(
        seed, q_lens, k_lens, page_size=16, kv_heads=1, group=group, head_dim=16,
        dtype=torch.float32, device=triton_device,
    )  # fmt: skip
    assert_close(run_triton(batch), oracle(batch), seed, "append_prefill", "block edges")


def test_long_prefixes_over_many_blocks(triton_device: torch.device) -> None:
    """Prefixes of several hundred keys: many unmasked blocks before the diagonal, several tiles."""
    seed = fresh_seed()
    rng = random.Random(seed)
    k_lens = [rng.randint(300, 700) for _ in range(3)]
    q_lens = [rng.randint(1, 90), rng.randint(100, 200), 1]
    batch = make_batch(
        seed, q_lens, k_lens, page_size=16, kv_heads=1, group=4, head_dim=32,
        dtype=torch.bfloat16, device=triton_device,
    )  # fmt: skip
    detail = f"q_lens={q_lens} k_lens={k_lens}"
    assert_close(run_triton(batch), oracle(batch), seed, "append_prefill", detail)
