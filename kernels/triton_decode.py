"""Decode attention over a paged KV cache, split along K (flash-decoding), in Triton (CUDA path).

Stage 1: a program per (sequence, KV head, split) streams its share of the sequence's keys through
the page table, for all GROUP query heads of that KV head at once (rows of one tile, padded to 16
for the tensor cores), and writes a partial output plus its log-sum-exp. A sequence of length L is
cut into `num_splits` equal, BLOCK_N-aligned ranges, so long and short sequences share one grid;
ranges past the end are empty and write lse = -inf. Stage 2: a program per (sequence, query head)
merges the splits by their LSE weights. With enough splits a batch of one long sequence still
occupies every SM. Never reads a slot at or beyond seq_lens[b]; never validates (dispatch does).

Triton reads parameter annotations as its own types, so the @triton.jit functions carry none;
the Python launchers below are fully typed.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import cdiv, next_power_of_two, softmax_scale_or_default

LOG2_E = 1.4426950408889634
BLOCK_N = 64
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def _decode_split_kernel(
    Q, K, V, PartialOut, PartialLse, PageTable, SeqLens, qk_scale,
    stride_qb, stride_qh, stride_pt, stride_page, stride_slot, stride_kh,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    page_row = PageTable + seq.to(tl.int64) * stride_pt
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_kh
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        page = tl.load(page_row + offs_n // PAGE_SIZE, mask=key_ok, other=0)
        slots = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_slot
        kt = tl.load(
            k_base + slots[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & key_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slots[:, None] + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    po = (
        PartialOut
        + seq.to(tl.int64) * stride_pob
        + heads[:, None] * stride_poh
        + split * stride_pos
        + offs_d[None, :]
    )
    tl.store(po, out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(PartialLse + seq * stride_plb + heads * stride_plh + split, lse, mask=h_ok)


@triton.jit
def _decode_merge_kernel(
    PartialOut, PartialLse, Out,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(
        PartialLse + seq * stride_plb + head * stride_plh + offs_s, mask=s_ok, other=float("-inf")
    )
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    po = (
        PartialOut
        + seq.to(tl.int64) * stride_pob
        + head * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :]
    )
    parts = tl.load(po, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_ptrs = Out + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough splits for ~4 programs per SM, at most one per MIN_KEYS_PER_SPLIT keys, <= 64.

    `max_seq_len` is an upper bound (the page table's capacity), known without a synchronisation.
    """
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    wanted = cdiv(4 * num_sms, batch * kv_heads)
    useful = cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def decode_attention_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_splits: int,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """decode_attention with an explicit number of K splits (tests and benchmarks pick it)."""
    assert 1 <= num_splits <= MAX_SPLITS, (
        f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"
    )
    out = torch.empty_like(q) if out is None else out
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    scale = softmax_scale_or_default(softmax_scale, head_dim)
    block_d = max(16, next_power_of_two(head_dim))
    partial_out = torch.empty(
        (batch, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
    po_strides = (partial_out.stride(0), partial_out.stride(1), partial_out.stride(2))
    pl_strides = (partial_lse.stride(0), partial_lse.stride(1))
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, partial_out, partial_lse, page_table, seq_lens, scale * LOG2_E,
        q.stride(0), q.stride(1), page_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *po_strides, *pl_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=max(16, next_power_of_two(group)),
        BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits, PAGE_SIZE=k_cache.shape[1],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )  # fmt: skip
    _decode_merge_kernel[(batch, q_heads)](
        partial_out, partial_lse, out, *po_strides, *pl_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, next_power_of_two(num_splits)), num_warps=4,
    )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, q_heads, head_dim]: one query per sequence over its first seq_lens[b] slots."""
    capacity = page_table.shape[1] * k_cache.shape[1]
    splits = choose_num_splits(q.shape[0], k_cache.shape[2], capacity, q.device)
    return decode_attention_split(
        q, k_cache, v_cache, page_table, seq_lens,
        num_splits=splits, softmax_scale=softmax_scale, out=out,
    )  # fmt: skip
