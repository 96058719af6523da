"""Scatter new K and V rows into their paged-cache slots, in Triton (the CUDA path).

One program copies BLOCK_T tokens; a token's kv_heads * head_dim values are one row of the tile,
read through k's strides (k may be a view into a fused QKV projection) and written contiguously
into its slot. A token whose slot is negative (padding) is skipped. Never reads or writes any slot
other than the ones in `slot_mapping`; never validates (dispatch does that).

Triton reads parameter annotations as its own types, so the @triton.jit functions carry none;
the Python launchers below are fully typed.
"""

# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import next_power_of_two

ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _write_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    SlotMapping,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(SlotMapping + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_ROW)
    head, dim = cols // HEAD_DIM, cols % HEAD_DIM
    mask = (slots >= 0)[:, None] & (cols < ROW)[None, :]
    tokens64 = tokens.to(tl.int64)[:, None]
    k = tl.load(K + tokens64 * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(V + tokens64 * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    dst = slots[:, None] * stride_cache_slot + cols[None, :]
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache.view(-1, kv_heads, head_dim)[slot_mapping[t]] = k[t] (same for v); slot < 0 skips."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    kv_heads, head_dim = k.shape[1], k.shape[2]
    row = kv_heads * head_dim
    block_row = next_power_of_two(row)
    block_t = max(1, min(next_power_of_two(num_tokens), ELEMENTS_PER_PROGRAM // block_row))
    grid = (triton.cdiv(num_tokens, block_t),)
    _write_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK_ROW=block_row,
        BLOCK_T=block_t,
    )
