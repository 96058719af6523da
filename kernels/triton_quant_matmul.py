"""Weight-only int4 / int8 matmul in Triton (the CUDA path): dequantize tiles in registers.

kernels/quant_matmul.py draws the layouts. One program per (row block, column block) of y:

    for each K tile:  x tile [BLOCK_M, BLOCK_K]                       (activations)
                      q tile [BLOCK_K, BLOCK_N] from the packed bytes (int4: byte k // 2 of the
                                                 row, shifted by 4 * (k % 2), masked to 4 bits)
                      w = (q - OFFSET) * scale[k // G] + zero[k // G], in float32, cast to x's
                          dtype for the dot (float32 x: an ieee float32 dot)
                      acc += x @ w

Each weight byte is read from memory once per row block (int4 bytes twice, adjacent: the same
cache line), and no float copy of W ever exists; the scale and zero of each element are
gathered from their [N, K / G] tables (G is any divisor of K, so int8 per channel, G = K, works
too). Decode (M = 1) runs BLOCK_M = 16, the smallest tl.dot takes; the idle rows cost compute, not
memory traffic, and decode is memory-bound. Accumulates in float32, stores x's dtype. Never
validates (kernels/quant_matmul.py does).

One row (decode of one sequence) takes a matrix-vector kernel instead, `_quant_gemv_kernel`: the
tile kernel's programs were one per 64 outputs, each walking all of K, too few to keep an H100
busy (an int4 Llama-3-8B `down_proj`, 4,096 x 14,336, one program per SM or fewer) and its
weight tiles [K, N] gathered a byte at a time. The row kernel reads [BLOCK_N, BLOCK_K] tiles
along the packed rows (contiguous bytes), splits K across programs until there are about four
per SM, and sums each group before scaling it:

    y[n] = sum over groups g of  scale[n, g] * sum_{k in g} x[k] * (q[n, k] - OFFSET)
                               + zero[n, g]  * sum_{k in g} x[k]

in float32 (the weight is never rounded to x's dtype, so a row's products are at least as exact
as the tile kernel's, and a row alone and the same row in a batch differ in the last bits for
bf16 / fp16 x); the splits' partial sums [SPLIT, N] are added by one torch sum. Measured on an
H100 (bf16 x, copies cycled past L2, GPU time of CUDA-graph replays, medians;
benchmarks/quant_matmul_gpu_bench.py; the tile kernel's 16-row time is its one-row time, one row
block either way): int4 Llama-3-8B gate_up 28,672 x 4,096 216 -> 55 us, down 315 -> 36 us, the
head 128,256 x 4,096 832 -> 184 us (60 % of the copy bandwidth); int8 head 584 -> 191 us (92 %).
At 4 rows the row kernel re-reads the weight once a row and was no faster overall in the
sweep, so rows > 1 keep the tile kernel.

Triton reads parameter annotations as its own types, so the @triton.jit functions carry none;
the Python launcher is typed.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from kernels.layout import cdiv

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _quant_matmul_kernel(
    X, Values, Scales, Zeros, Y,
    M, N, K,
    stride_xm, stride_xk, stride_vn, stride_sn, stride_ym, stride_yn,
    GROUP: tl.constexpr, INT4: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_ok = k_ok[:, None] & n_ok[None, :]
        if INT4:
            byte = tl.load(
                Values + offs_n[None, :] * stride_vn + (offs_k[:, None] // 2), mask=w_ok, other=0
            )
            q = (byte >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 15
            w = q.to(tl.float32) - 8.0
        else:
            q = tl.load(Values + offs_n[None, :] * stride_vn + offs_k[:, None], mask=w_ok, other=0)
            w = q.to(tl.float32)
        group_at = offs_n[None, :] * stride_sn + offs_k[:, None] // GROUP
        w = w * tl.load(Scales + group_at, mask=w_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            w = w + tl.load(Zeros + group_at, mask=w_ok, other=0.0).to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _quant_gemv_kernel(
    X, Values, Scales, Zeros, Partial,
    N, K,
    stride_vn, stride_sn,
    GROUP: tl.constexpr, INT4: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # groups in a K tile: several (BLOCK_K % GROUP == 0), or the tile lies inside one
    GROUPS: tl.constexpr = BLOCK_K // GROUP if BLOCK_K % GROUP == 0 else 1
    PER_GROUP: tl.constexpr = GROUP // 2 if INT4 else GROUP  # columns of a group in a tile
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        if INT4:  # bytes k0 / 2 ...: even k in the low nibbles, odd k in the high ones
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b_ok = offs_b < K // 2
            byte = tl.load(
                Values + offs_n[:, None] * stride_vn + offs_b[None, :],
                mask=n_ok[:, None] & b_ok[None, :],
                other=0,
            )
            x_even = tl.load(X + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(X + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)
            products = ((byte & 15).to(tl.float32) - 8.0) * x_even[None, :]
            products += ((byte >> 4).to(tl.float32) - 8.0) * x_odd[None, :]
            inputs = x_even + x_odd
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            q = tl.load(
                Values + offs_n[:, None] * stride_vn + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :],
                other=0,
            )
            inputs = tl.load(X + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            products = q.to(tl.float32) * inputs[None, :]
        if GROUPS == 1:
            sums = tl.sum(products, axis=1)[:, None]
            input_sums = tl.sum(inputs, axis=0)
        else:
            sums = tl.sum(tl.reshape(products, [BLOCK_N, GROUPS, PER_GROUP]), axis=2)
            input_sums = tl.sum(tl.reshape(inputs, [GROUPS, PER_GROUP]), axis=1)
        g = k0 // GROUP + tl.arange(0, GROUPS)
        g_ok = n_ok[:, None] & (g < K // GROUP)[None, :]
        at = offs_n[:, None] * stride_sn + g[None, :]
        acc += tl.sum(sums * tl.load(Scales + at, mask=g_ok, other=0.0).to(tl.float32), axis=1)
        if HAS_ZEROS:
            zero = tl.load(Zeros + at, mask=g_ok, other=0.0).to(tl.float32)
            acc += tl.sum(zero * input_sums[None, :], axis=1)
    tl.store(Partial + pid_k * N + offs_n, acc, mask=n_ok)


GEMV_BLOCK_N = 32
GEMV_WARPS = 4
GEMV_PROGRAMS_PER_SM = 4


@cache
def gemv_block_k(k: int, group_size: int) -> int | None:
    """The row kernel's K tile for these inputs: 256 (the best of 64 / 128 / 256 on the H100
    sweep) or the largest tile that keeps each tile's groups whole, None if none does (then
    the tile kernel runs). A tile may hold whole groups (a power-of-two group dividing it) or lie
    inside one group (the group a multiple of the tile, or one group a row: int8 per channel)."""
    for block_k in (256, 128, 64):  # a group of 1 would split int4's bytes: never whole
        whole = block_k % group_size == 0 and group_size >= 2 and group_size & (group_size - 1) == 0
        if whole or group_size % block_k == 0 or group_size == k:
            return block_k
    return None


def gemv_split(k: int, n: int, block_k: int, programs: int) -> int:
    """Inputs each program of the row kernel sums (whole K tiles): K cut into as many parts as
    bring the programs to about `programs`, never more parts than tiles."""
    blocks_n, blocks_k = cdiv(n, GEMV_BLOCK_N), cdiv(k, block_k)
    split = max(1, min(blocks_k, cdiv(programs, blocks_n)))
    return cdiv(blocks_k, split) * block_k


def quant_gemv(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group_size: int,
    block_k: int,
    programs: int,
) -> torch.Tensor:
    """y [1, N] for one row x [1, K] by the row kernel, K split until about `programs` run."""
    k, n = x.shape[1], values.shape[0]
    per_split = gemv_split(k, n, block_k, programs)
    split = cdiv(k, per_split)
    partial = torch.empty((split, n), dtype=torch.float32, device=x.device)
    row = x[0] if x.stride(1) == 1 else x[0].contiguous()
    _quant_gemv_kernel[(cdiv(n, GEMV_BLOCK_N), split)](
        row, values, scales, zeros if zeros is not None else scales, partial,
        n, k,
        values.stride(0), scales.stride(0),
        GROUP=group_size, INT4=fmt == "int4", HAS_ZEROS=zeros is not None,
        BLOCK_N=GEMV_BLOCK_N, BLOCK_K=block_k, K_PER_SPLIT=per_split, num_warps=GEMV_WARPS,
    )  # fmt: skip
    total = partial[0] if split == 1 else partial.sum(0)
    return total.to(x.dtype)[None, :]


@cache
def _programs(device: torch.device) -> int:
    """Programs the row kernel aims for: GEMV_PROGRAMS_PER_SM per SM (8 under the interpreter)."""
    if device.type != "cuda":
        return 8
    return GEMV_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def quant_matmul(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group_size: int,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ W.T in x's dtype (kernels/quant_matmul.py draws the layouts); one row by
    the row kernel where `gemv_block_k` finds a tile, unless `block_m` asks for the tile kernel."""
    m, k = x.shape
    n = values.shape[0]
    if m == 1 and n and k and block_m is None:
        block_k = gemv_block_k(k, group_size)
        if block_k is not None:
            return quant_gemv(
                x, values, scales, zeros, fmt, group_size, block_k, _programs(x.device)
            )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = block_m or (16 if m <= 16 else 64)
    grid = (cdiv(m, block_m), cdiv(n, BLOCK_N))
    _quant_matmul_kernel[grid](
        x, values, scales, zeros if zeros is not None else scales, y,
        m, n, k,
        x.stride(0), x.stride(1), values.stride(0), scales.stride(0), y.stride(0), y.stride(1),
        GROUP=group_size, INT4=fmt == "int4", HAS_ZEROS=zeros is not None,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    return y
