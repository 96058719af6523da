"""Argument checks for the three kernel operations, run by dispatch before any backend.

Two kinds of check. Structural ones (rank, shape, dtype, device, contiguity) read only tensor
metadata and always run; they cost microseconds, so each is a plain `if` that formats its message
only on failure. Value ones (kernels/validate_values.py) read tensor contents: free on the CPU, a
device synchronisation on CUDA, so they run only when `check_values` is true (the default; the
engine's hot path turns them off). Every failure is a `KernelInputError` naming the argument.
Never mutates anything.
"""

from __future__ import annotations

import torch

from kernels import validate_values
from kernels.errors import KernelInputError
from kernels.layout import SUPPORTED_DTYPES, is_power_of_two

SLOT_DTYPES = (torch.int32, torch.int64)


def _check_index(t: torch.Tensor, name: str, length: int, device: torch.device) -> None:
    """An int32 vector of `length` entries on `device`."""
    if t.dtype != torch.int32:
        raise KernelInputError(name, f"must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        raise KernelInputError(name, f"must have shape [{length}], got {list(t.shape)}")
    if t.device != device:
        raise KernelInputError(name, f"is on {t.device}, the cache is on {device}")


def _check_rows(t: torch.Tensor, name: str, cache: torch.Tensor, rank: int = 3) -> None:
    """Same dtype and device as the cache; last dimension contiguous."""
    if t.dim() != rank:
        raise KernelInputError(name, f"must have {rank} dimensions, got {list(t.shape)}")
    if t.dtype != cache.dtype:
        raise KernelInputError(name, f"dtype {t.dtype} differs from the cache's {cache.dtype}")
    if t.device != cache.device:
        raise KernelInputError(name, f"is on {t.device}, the cache is on {cache.device}")
    if t.stride(-1) != 1:
        raise KernelInputError(name, "last dimension must be contiguous (stride 1)")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """A [num_pages, page_size (power of two), kv_heads, head_dim] contiguous pair."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            shape = list(cache.shape)
            raise KernelInputError(name, f"must be [pages, page_size, heads, dim], got {shape}")
        if cache.dtype not in SUPPORTED_DTYPES:
            raise KernelInputError(name, f"dtype {cache.dtype} is not one of {SUPPORTED_DTYPES}")
        if not cache.is_contiguous():
            raise KernelInputError(name, "must be contiguous")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        theirs, ours = (v_cache.dtype, list(v_cache.shape)), (k_cache.dtype, list(k_cache.shape))
        raise KernelInputError("v_cache", f"{theirs} differs from k_cache's {ours}")
    if v_cache.device != k_cache.device:
        raise KernelInputError("v_cache", f"is on {v_cache.device}, k_cache on {k_cache.device}")
    if k_cache.numel() == 0:
        raise KernelInputError("k_cache", f"has an empty dimension: {list(k_cache.shape)}")
    if not is_power_of_two(k_cache.shape[1]):
        raise KernelInputError("k_cache", f"page_size {k_cache.shape[1]} is not a power of two")


def _check_query(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """q is [tokens, q_heads, head_dim] with q_heads a multiple of the cache's kv_heads."""
    _check_rows(q, "q", k_cache)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != head_dim:
        raise KernelInputError("q", f"head_dim {q.shape[2]} differs from the cache's {head_dim}")
    if q.shape[1] % kv_heads != 0:
        raise KernelInputError("q", f"{q.shape[1]} heads: not a multiple of kv_heads {kv_heads}")


def _check_page_table(page_table: torch.Tensor, batch: int, device: torch.device) -> None:
    if page_table.dtype != torch.int32:
        raise KernelInputError("page_table", f"must be int32, got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] < batch:
        shape = list(page_table.shape)
        raise KernelInputError("page_table", f"must be [>= {batch} rows, pages], got {shape}")
    if page_table.stride(1) != 1:
        raise KernelInputError("page_table", "last dimension must be contiguous (stride 1)")
    if page_table.device != device:
        raise KernelInputError("page_table", f"is on {page_table.device}, the cache on {device}")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> None:
    if out is None:
        return
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise KernelInputError("out", f"{out.dtype} {list(out.shape)} on {out.device} != q's")
    if not out.is_contiguous():
        raise KernelInputError("out", "must be contiguous")


def _check_regions(image_regions: torch.Tensor | None, device: torch.device) -> None:
    if image_regions is None:
        return
    if image_regions.dtype != torch.int32 or image_regions.dim() != 2:
        raise KernelInputError(
            "image_regions", f"must be int32 [regions, 3], got {image_regions.dtype}"
        )
    if image_regions.shape[1] != 3:
        shape = list(image_regions.shape)
        raise KernelInputError("image_regions", f"rows are (seq, start, end), got {shape}")
    if image_regions.device != device:
        raise KernelInputError(
            "image_regions", f"is on {image_regions.device}, the cache on {device}"
        )


def check_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_values: bool,
) -> None:
    check_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        _check_rows(t, name, k_cache)
        if t.shape[1:] != k_cache.shape[2:] or t.shape[0] != k.shape[0]:
            want = [k.shape[0], *k_cache.shape[2:]]
            raise KernelInputError(
                name, f"must be {want} (tokens, kv_heads, head_dim), got {list(t.shape)}"
            )
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise KernelInputError("slot_mapping", f"must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (k.shape[0],):
        shape = list(slot_mapping.shape)
        raise KernelInputError("slot_mapping", f"must have shape [{k.shape[0]}], got {shape}")
    if slot_mapping.device != k_cache.device:
        raise KernelInputError("slot_mapping", f"is on {slot_mapping.device}, the cache is not")
    if check_values:
        validate_values.check_slots(slot_mapping, k_cache)


def check_append_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    image_regions: torch.Tensor | None,
    out: torch.Tensor | None,
    check_values: bool,
) -> None:
    check_kv_cache(k_cache, v_cache)
    _check_query(q, k_cache)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        shape = list(cu_seqlens_q.shape)
        raise KernelInputError("cu_seqlens_q", f"must be [batch + 1], batch >= 1; got {shape}")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index(cu_seqlens_q, "cu_seqlens_q", batch + 1, k_cache.device)
    _check_index(seq_lens_k, "seq_lens_k", batch, k_cache.device)
    _check_page_table(page_table, batch, k_cache.device)
    _check_out(out, q)
    _check_regions(image_regions, k_cache.device)
    if check_values:
        validate_values.check_chunks(cu_seqlens_q, seq_lens_k, q.shape[0])
        validate_values.check_kv_lengths(seq_lens_k, "seq_lens_k", k_cache, page_table)
        if image_regions is not None:
            validate_values.check_image_regions(image_regions, seq_lens_k)


def check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    check_values: bool,
) -> None:
    check_kv_cache(k_cache, v_cache)
    _check_query(q, k_cache)
    if q.shape[0] == 0:
        raise KernelInputError("q", "decode needs at least one sequence")
    _check_index(seq_lens, "seq_lens", q.shape[0], k_cache.device)
    _check_page_table(page_table, q.shape[0], k_cache.device)
    _check_out(out, q)
    if check_values:
        validate_values.check_kv_lengths(seq_lens, "seq_lens", k_cache, page_table)
