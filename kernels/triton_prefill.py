"""Append-prefill attention over a paged KV cache, in Triton (the CUDA path).

A program computes one tile of BLOCK_M query rows against one KV head. The rows are (position,
query head) pairs of the GROUP query heads that share that KV head, position-major (GQA packing):
every K/V block fetched through the page table serves all of them, and a short query chunk over
a long prefix still fills a tile. The KV loop is FlashAttention's online softmax in two stages:
the blocks every row of the tile sees in full (no mask), then the blocks along the right-aligned
causal diagonal (masked). Two kernels, picked by the launcher:

    causal      row r (position p of a chunk of q_len over seq_len_k keys) sees keys 0 .. last(r),
                last(r) = seq_len_k - q_len + p
    prefix-LM   last(r) comes from a per-token `horizon` (kernels/masks.py): a position inside a
                bidirectional image region also sees the rest of its region

Never reads a K/V slot at or beyond seq_len_k (V is masked, so unwritten slots full of NaN cannot
leak in); never validates its arguments (dispatch does).

Triton reads parameter annotations as its own types, so the @triton.jit functions carry none;
the Python launchers below are fully typed.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import next_power_of_two, softmax_scale_or_default
from kernels.masks import query_horizons

LOG2_E = 1.4426950408889634


@triton.jit
def _kv_slots(page_row, offs_n, seq_len_k, stride_page, stride_slot, PAGE_SIZE: tl.constexpr):
    """Element offsets of KV positions `offs_n` through one page-table row (page 0 past the end)."""
    page = tl.load(page_row + offs_n // PAGE_SIZE, mask=offs_n < seq_len_k, other=0)
    return page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_slot


@triton.jit
def _attend(
    acc, m_i, l_i, q, k_base, v_base, page_row, lo, hi, seq_len_k, last_key,
    stride_page, stride_slot, offs_d, d_ok, qk_scale,
    MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax over KV blocks [lo, hi); MASKED applies `key <= last_key[row]`."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        slots = _kv_slots(page_row, offs_n, seq_len_k, stride_page, stride_slot, PAGE_SIZE)
        if MASKED:
            key_ok = offs_n < seq_len_k
            kt = tl.load(
                k_base + slots[None, :] + offs_d[:, None],
                mask=d_ok[:, None] & key_ok[None, :],
                other=0.0,
            )
            v = tl.load(
                v_base + slots[:, None] + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
        else:
            kt = tl.load(k_base + slots[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + slots[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            s = tl.where(offs_n[None, :] <= last_key[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tile(
    Q, K, V, Out, page_row, q_start, q_len, seq_len_k, kv_head, first_row, last_key, hi,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_slot, stride_kh, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Load the tile's queries, run both stages, normalise, store. `hi`: end of the masked stage."""
    rows = first_row + tl.arange(0, BLOCK_M)
    pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < q_len * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + pos).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + (head * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # Keys up to the first row's own position are visible to every row: no mask needed there.
    first_pos = seq_len_k - q_len + first_row // GROUP
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, hi)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_kh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, k_base, v_base, page_row, 0, full_end, seq_len_k, last_key,
        stride_page, stride_slot, offs_d, d_ok, qk_scale, False, PAGE_SIZE, BLOCK_N, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, k_base, v_base, page_row, full_end, hi, seq_len_k, last_key,
        stride_page, stride_slot, offs_d, d_ok, qk_scale, True, PAGE_SIZE, BLOCK_N, PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptrs = Out + q_rows[:, None] * stride_ot + (head * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _prefill_causal_kernel(
    Q, K, V, Out, PageTable, CuSeqlensQ, SeqLensK, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_pt, stride_page, stride_slot, stride_kh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) tiles start first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    first_row = tile * BLOCK_M
    if first_row >= q_len * GROUP:
        return
    seq_len_k = tl.load(SeqLensK + seq)
    rows = first_row + tl.arange(0, BLOCK_M)
    last_key = tl.minimum(seq_len_k - q_len + rows // GROUP, seq_len_k - 1)
    last_row = tl.minimum(first_row + BLOCK_M, q_len * GROUP) - 1
    hi = seq_len_k - q_len + last_row // GROUP + 1
    page_row = PageTable + seq.to(tl.int64) * stride_pt
    _tile(
        Q, K, V, Out, page_row, q_start, q_len, seq_len_k, kv_head, first_row, last_key, hi,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_slot, stride_kh, qk_scale,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, PRECISION,
    )  # fmt: skip


@triton.jit
def _prefill_prefix_lm_kernel(
    Q, K, V, Out, PageTable, CuSeqlensQ, SeqLensK, Horizon, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_pt, stride_page, stride_slot, stride_kh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    first_row = tile * BLOCK_M
    if first_row >= q_len * GROUP:
        return
    seq_len_k = tl.load(SeqLensK + seq)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    horizon = tl.load(Horizon + q_start + rows // GROUP, mask=row_ok, other=0)
    last_key = tl.minimum(horizon, seq_len_k - 1)
    hi = tl.max(tl.where(row_ok, last_key, 0), 0) + 1
    page_row = PageTable + seq.to(tl.int64) * stride_pt
    _tile(
        Q, K, V, Out, page_row, q_start, q_len, seq_len_k, kv_head, first_row, last_key, hi,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_slot, stride_kh, qk_scale,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, PRECISION,
    )  # fmt: skip


def tile_config(head_dim: int) -> dict[str, int]:
    """BLOCK_M / BLOCK_N / warps / stages by head_dim (tuned for H100-class GPUs, bf16)."""
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact (ieee) products on tensor-core GPUs, not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def append_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    image_regions: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query chunk q[cu[i]:cu[i+1]] attends to its sequence's first seq_lens_k[i] KV slots.

    `max_seqlen_q` sizes the grid; pass it to avoid a device synchronisation.
    """
    out = torch.empty_like(q) if out is None else out
    total_q, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    batch = cu_seqlens_q.shape[0] - 1
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    scale = softmax_scale_or_default(softmax_scale, head_dim)
    config = tile_config(head_dim)
    block_m = config.pop("BLOCK_M")
    grid = (triton.cdiv(max_seqlen_q * group, block_m), batch, kv_heads)
    args = [q, k_cache, v_cache, out, page_table, cu_seqlens_q, seq_lens_k]
    if image_regions is not None and image_regions.shape[0] > 0:
        kernel = _prefill_prefix_lm_kernel
        args.append(query_horizons(cu_seqlens_q, seq_lens_k, image_regions, total_q))
    else:
        kernel = _prefill_causal_kernel
    kernel[grid](
        *args,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_two(head_dim)),
        BLOCK_M=block_m,
        PAGE_SIZE=k_cache.shape[1],
        PRECISION=dot_precision(q.dtype),
        **config,
    )
    return out
