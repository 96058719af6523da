"""LoRA shrink and expand over segments of rows (SGMV), in Triton (the CUDA path).

kernels/lora.py draws the segment layout. Both kernels run one grid over

    axis 0   segment g                    rows seg_starts[g] : seg_starts[g + 1], slot seg_slots[g]
    axis 1   (row block, column block)    row blocks past the segment's end do nothing
    axis 2   split of the K loop          shrink only (decode: few rows, a long `in`)

so no host synchronisation is needed: the number of row blocks is bounded by T, the batch's rows.
A program of a slot -1 segment runs no loop: shrink writes zeros to its rows (split 0 only),
expand stores nothing. Products accumulate in float32; shrink with split-K adds its partial sums
into a zeroed float32 `h` with atomics, then casts. Never validates (kernels/lora.py does).

Triton reads parameter annotations as its own types, so the @triton.jit functions carry none;
the Python launchers below are fully typed.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import cdiv, next_power_of_two

MAX_SPLIT_K = 16
SHRINK_BLOCK_K = 128


@triton.jit
def _shrink_kernel(
    X, A, H, SegStarts, SegSlots,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ht, stride_hr,
    IN, RANK,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    r_blocks = tl.cdiv(RANK, BLOCK_R)
    m_block = tl.program_id(1) // r_blocks
    r_block = tl.program_id(1) % r_blocks
    split = tl.program_id(2)
    start = tl.load(SegStarts + seg).to(tl.int64)
    end = tl.load(SegStarts + seg + 1).to(tl.int64)
    slot = tl.load(SegSlots + seg).to(tl.int64)
    offs_m = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    live = (slot >= 0) & (start + m_block * BLOCK_M < end)  # a row block past its segment: idle
    k_end = tl.where(live, IN, 0)  # slot -1: no loop, zeros
    x_rows = X + offs_m[:, None] * stride_xt
    a_rows = A + tl.maximum(slot, 0) * stride_as + offs_r[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(split * BLOCK_K, k_end, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < IN
        x = tl.load(
            x_rows + offs_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        at = tl.load(
            a_rows + offs_k[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0
        )
        acc += tl.dot(x, at, input_precision=PRECISION)
    h_ptrs = H + offs_m[:, None] * stride_ht + offs_r[None, :] * stride_hr
    h_ok = m_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc.to(H.dtype.element_ty), mask=h_ok)
    else:  # H is a zeroed float32 buffer; an empty split adds zeros
        tl.atomic_add(h_ptrs, acc, mask=h_ok & (k_end > 0))


@triton.jit
def _expand_kernel(
    H, B, Y, SegStarts, SegSlots,
    stride_ht, stride_hr, stride_bs, stride_bo, stride_br, stride_yt, stride_yo,
    OUT, RANK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    n_blocks = tl.cdiv(OUT, BLOCK_N)
    m_block = tl.program_id(1) // n_blocks
    n_block = tl.program_id(1) % n_blocks
    start = tl.load(SegStarts + seg).to(tl.int64)
    end = tl.load(SegStarts + seg + 1).to(tl.int64)
    slot = tl.load(SegSlots + seg).to(tl.int64)
    offs_m = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < end
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < OUT
    live = (slot >= 0) & (start + m_block * BLOCK_M < end)  # a row block past its segment: idle
    r_end = tl.where(live, RANK, 0)  # slot -1: no loop, no store
    h_rows = H + offs_m[:, None] * stride_ht
    b_cols = B + tl.maximum(slot, 0) * stride_bs + offs_n[None, :] * stride_bo
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, r_end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < RANK
        h = tl.load(
            h_rows + offs_r[None, :] * stride_hr, mask=m_ok[:, None] & r_ok[None, :], other=0.0
        )
        bt = tl.load(
            b_cols + offs_r[:, None] * stride_br, mask=r_ok[:, None] & n_ok[None, :], other=0.0
        )
        acc += tl.dot(h, bt, input_precision=PRECISION)
    y_ptrs = Y + offs_m[:, None] * stride_yt + offs_n[None, :] * stride_yo
    y_ok = m_ok[:, None] & n_ok[None, :] & (r_end > 0)
    y = tl.load(y_ptrs, mask=y_ok)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=y_ok)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16 / bf16 dots ignore it


def _block_m(rows: int, segments: int) -> int:
    """16 rows for decode-like batches (about a row per segment), 64 for long segments."""
    return 16 if rows <= 16 * max(segments, 1) else 64


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def choose_split_k(
    rows: int, segments: int, rank: int, in_features: int, device: torch.device
) -> int:
    """Enough K splits for ~2 programs per SM, at most one per SHRINK_BLOCK_K columns, <= 16."""
    block_r = min(64, max(16, next_power_of_two(rank)))
    programs = segments * cdiv(rows, _block_m(rows, segments)) * cdiv(rank, block_r)
    wanted = cdiv(2 * _sm_count(device), max(programs, 1))
    useful = cdiv(in_features, SHRINK_BLOCK_K)
    return max(1, min(wanted, useful, MAX_SPLIT_K))


def lora_shrink_split(
    x: torch.Tensor,
    a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    split_k: int,
    block_m: int | None = None,
) -> torch.Tensor:
    """lora_shrink with an explicit number of K splits and rows per block (tests pick them)."""
    assert 1 <= split_k <= MAX_SPLIT_K, f"split_k must be in [1, {MAX_SPLIT_K}], got {split_k}"
    rows, in_features = x.shape
    rank = a.shape[1]
    segments = seg_slots.shape[0]
    block_m = _block_m(rows, segments) if block_m is None else block_m
    block_r = min(64, max(16, next_power_of_two(rank)))
    h = (
        torch.empty((rows, rank), dtype=x.dtype, device=x.device)
        if split_k == 1
        else torch.zeros((rows, rank), dtype=torch.float32, device=x.device)
    )
    if rows == 0 or segments == 0 or rank == 0:
        return h.to(x.dtype)
    grid = (segments, cdiv(rows, block_m) * cdiv(rank, block_r), split_k)
    _shrink_kernel[grid](
        x, a, h, seg_starts, seg_slots,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        in_features, rank,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K, SPLIT_K=split_k,
        PRECISION=_precision(x.dtype), num_warps=4,
    )  # fmt: skip
    return h if split_k == 1 else h.to(x.dtype)


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """h [T, rank] = x @ a[slot].T per segment (zeros where the slot is -1), in x's dtype."""
    split_k = choose_split_k(x.shape[0], seg_slots.shape[0], a.shape[1], x.shape[1], x.device)
    return lora_shrink_split(x, a, seg_starts, seg_slots, split_k=split_k)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    block_m: int | None = None,
) -> None:
    """y[rows] += h[rows] @ b[slot].T per segment, in place; rows of slot -1 untouched."""
    rows, out_features = y.shape
    rank = h.shape[1]
    segments = seg_slots.shape[0]
    if rows == 0 or segments == 0 or rank == 0:
        return
    block_m = _block_m(rows, segments) if block_m is None else block_m
    block_n = min(128, max(16, next_power_of_two(out_features)))
    block_r = min(64, max(16, next_power_of_two(rank)))
    grid = (segments, cdiv(rows, block_m) * cdiv(out_features, block_n))
    _expand_kernel[grid](
        h, b, y, seg_starts, seg_slots,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        out_features, rank,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=_precision(y.dtype),
        num_warps=4,
    )  # fmt: skip
