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

Triton reads parameter annotations as its own types, so the @triton.jit function carries none;
the Python launcher is typed.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

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
    """y [M, N] = x @ W.T in x's dtype (kernels/quant_matmul.py draws the layouts)."""
    m, k = x.shape
    n = values.shape[0]
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
