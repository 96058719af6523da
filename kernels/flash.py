"""flash-attn (FA2) behind the kernels contract, used where its constraints fit; optional.

FA2 reads a paged cache (`block_table`) only when page_size is a multiple of 256 (flash_api.cpp:
"Paged KV cache block size must be divisible by 256"), holds fp16/bf16 only, head_dim <= 256 and a
multiple of 8, and has no prefix-LM mask. Its causal mask is aligned to the bottom-right corner
(flash-attn >= 2.1), which is exactly our right alignment seq_len_k - seq_len_q. Where all of that
holds, dispatch prefers it; anywhere else `why_not` says why. An absent or broken flash-attn is
not an error: `AVAILABLE` is false and dispatch moves on. Never imported by anything on the CPU
path as a requirement.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from kernels.layout import softmax_scale_or_default


def _optional_function(module: str, name: str) -> Callable[..., Any] | None:
    try:
        function: Callable[..., Any] = getattr(importlib.import_module(module), name)
    except (ImportError, OSError, AttributeError):  # absent, or built for another torch / CUDA
        return None
    return function


varlen_func = _optional_function("flash_attn", "flash_attn_varlen_func")
kvcache_func = _optional_function("flash_attn", "flash_attn_with_kvcache")
AVAILABLE = varlen_func is not None and kvcache_func is not None
PAGE_SIZE_MULTIPLE = 256


def why_not(
    device: torch.device, dtype: torch.dtype, page_size: int, head_dim: int, has_regions: bool
) -> str | None:
    """None when FA2 can run this call, else the first reason it cannot."""
    reasons = (
        (not AVAILABLE, "flash-attn is not importable"),
        (device.type != "cuda", "flash-attn needs CUDA tensors"),
        (dtype not in (torch.float16, torch.bfloat16), f"flash-attn does not take {dtype}"),
        (page_size % PAGE_SIZE_MULTIPLE != 0, f"FA2 needs page_size % 256 == 0, got {page_size}"),
        (head_dim > 256 or head_dim % 8 != 0, f"FA2 needs head_dim <= 256, % 8 == 0: {head_dim}"),
        (has_regions, "flash-attn has no prefix-LM (image region) mask"),
    )
    return next((why for failed, why in reasons if failed), None)


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
    """FA2 varlen over the paged cache, causal (bottom-right aligned). No image regions."""
    assert varlen_func is not None, "flash-attn is not importable; dispatch should not route here"
    assert image_regions is None, "flash-attn has no prefix-LM mask; dispatch should not route here"
    batch = seq_lens_k.shape[0]
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cu_seqlens_k = torch.nn.functional.pad(seq_lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    result = varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        page_table.shape[1] * k_cache.shape[1],
        softmax_scale=softmax_scale_or_default(softmax_scale, q.shape[-1]),
        causal=True,
        block_table=page_table[:batch],
    )
    if out is None:
        return result
    return out.copy_(result)


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
    """FA2 `flash_attn_with_kvcache` with one query per sequence (it splits K itself)."""
    assert kvcache_func is not None, "flash-attn is not importable; dispatch should not route here"
    result = kvcache_func(
        q.unsqueeze(1),
        k_cache,
        v_cache,
        cache_seqlens=seq_lens,
        block_table=page_table[: q.shape[0]],
        softmax_scale=softmax_scale_or_default(softmax_scale, q.shape[-1]),
        causal=False,
    ).squeeze(1)
    if out is None:
        return result
    return out.copy_(result)


def dense_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """FA2 varlen on contiguous K/V [total_k, kv_heads, head_dim]: the no-paging baseline."""
    assert varlen_func is not None, "flash-attn is not importable"
    result: torch.Tensor = varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale_or_default(softmax_scale, q.shape[-1]),
        causal=True,
    )
    return result
