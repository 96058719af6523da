"""The paged KV layout every backend shares, and the small helpers that compute with it.

One layer's cache is two tensors, K and V, each

    k_cache, v_cache : [num_pages, page_size, kv_heads, head_dim]   contiguous, same dtype

A token's K/V lives in one *slot*: `slot = page * page_size + offset`, so `k_cache.view(-1,
kv_heads, head_dim)[slot]` is that token's K. A sequence's KV positions 0, 1, 2, ... are spread
over pages through its row of the page table:

    page_table : [max_seqs, max_pages_per_seq] int32    row i belongs to sequence i of the batch

    position p of sequence i  ->  page page_table[i, p // page_size], offset p % page_size

        page_table[i] = [ 7 | 2 | 9 | 0 | 0 ]        page_size = 4, seq_len = 10
                          |   |   |   '---'--- unused entries: never read (the cache pads with
                          |   |   |            its null page 0; any value is fine)
                          |   |   '-- positions 8..9  (slots 36, 37; 38 and 39 unused)
                          |   '------ positions 4..7  (slots 8..11)
                          '---------- positions 0..3  (slots 28..31)

Entries past `cdiv(seq_len, page_size)` are never read. `page_size` is a power of two (1 included).
This module never launches a kernel and never synchronises with a device.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PADDING_SLOT = -1
"""A slot_mapping entry below zero means "no slot": write_kv skips that token (padding)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(a // -b)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    assert n >= 1, f"next_power_of_two needs n >= 1, got {n}"
    return 1 << (n - 1).bit_length()


def softmax_scale_or_default(softmax_scale: float | None, head_dim: int) -> float:
    """The attention scale every backend uses: `softmax_scale` when given, else head_dim ** -0.5."""
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def page_size_of(k_cache: torch.Tensor) -> int:
    return int(k_cache.shape[1])


def empty_kv_cache(
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate one layer's (k_cache, v_cache). Contents are uninitialised, as in serving."""
    assert is_power_of_two(page_size), f"page_size must be a power of two, got {page_size}"
    shape = (num_pages, page_size, kv_heads, head_dim)
    return (
        torch.empty(shape, dtype=dtype, device=device),
        torch.empty(shape, dtype=dtype, device=device),
    )


def slots_for_positions(
    page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """The int64 slots of KV `positions` of one sequence, through its page-table row."""
    positions = positions.to(torch.int64)
    pages = page_table_row.to(torch.int64)[positions // page_size]
    return pages * page_size + positions % page_size


def prefill_slot_mapping(
    page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, page_size: int
) -> torch.Tensor:
    """The slot of every query token of an append prefill (positions seq_len_k - seq_len_q ...).

    This is the slot_mapping that `write_kv` needs before `append_prefill_attention` runs.
    """
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    total = int(cu_seqlens_q[-1])
    batch = q_lens.numel()
    seq_of_token = torch.repeat_interleave(
        torch.arange(batch, device=q_lens.device), q_lens, output_size=total
    )
    starts = cu_seqlens_q[:-1].to(torch.int64)
    local = torch.arange(total, device=q_lens.device) - starts[seq_of_token]
    positions = local + (seq_lens_k.to(torch.int64) - q_lens)[seq_of_token]
    pages = page_table.to(torch.int64)[seq_of_token, positions // page_size]
    return pages * page_size + positions % page_size
