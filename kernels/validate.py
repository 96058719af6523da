"""Argument checks for the three kernel operations, run by the dispatch layer before any backend.

Two kinds of check. Structural ones (rank, shape, dtype, device, contiguity) read only tensor
metadata and always run. Value ones (page ids in range, lengths consistent, slots unique, image
regions well formed) read tensor contents: free on the CPU, a device synchronisation on CUDA, so
dispatch runs them only when `check_values` is true (the default; the engine's hot path turns them
off). Every failure is a `KernelInputError` naming the argument. Never mutates anything.
"""

from __future__ import annotations

import torch

from kernels.errors import KernelInputError
from kernels.layout import SUPPORTED_DTYPES, is_power_of_two

INDEX_DTYPES = (torch.int32,)
SLOT_DTYPES = (torch.int32, torch.int64)


def _need(condition: bool, argument: str, problem: str) -> None:
    if not condition:
        raise KernelInputError(argument, problem)


def _check_index(t: torch.Tensor, name: str, length: int, device: torch.device) -> None:
    _need(t.dtype in INDEX_DTYPES, name, f"must be int32, got {t.dtype}")
    _need(
        t.dim() == 1 and t.shape[0] == length,
        name,
        f"must have shape [{length}], got {list(t.shape)}",
    )
    _need(t.device == device, name, f"is on {t.device}, the cache is on {device}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check one layer's cache pair; return (num_pages, page_size, kv_heads, head_dim)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need(
            cache.dim() == 4,
            name,
            f"must be [num_pages, page_size, kv_heads, head_dim], got {list(cache.shape)}",
        )
        _need(
            cache.dtype in SUPPORTED_DTYPES,
            name,
            f"dtype {cache.dtype} is not one of {SUPPORTED_DTYPES}",
        )
        _need(cache.is_contiguous(), name, "must be contiguous")
    _need(
        v_cache.shape == k_cache.shape,
        "v_cache",
        f"shape {list(v_cache.shape)} differs from k_cache {list(k_cache.shape)}",
    )
    _need(
        v_cache.dtype == k_cache.dtype,
        "v_cache",
        f"dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}",
    )
    _need(
        v_cache.device == k_cache.device,
        "v_cache",
        f"is on {v_cache.device}, k_cache on {k_cache.device}",
    )
    num_pages, page_size, kv_heads, head_dim = (int(s) for s in k_cache.shape)
    _need(
        num_pages >= 1 and kv_heads >= 1 and head_dim >= 1,
        "k_cache",
        f"has an empty dimension: {list(k_cache.shape)}",
    )
    _need(
        is_power_of_two(page_size),
        "k_cache",
        f"page_size (dim 1) must be a power of two, got {page_size}",
    )
    return num_pages, page_size, kv_heads, head_dim


def _check_query(q: torch.Tensor, k_cache: torch.Tensor, name: str = "q") -> int:
    """Check a [tokens, q_heads, head_dim] query against the cache; return the batch size."""
    _, _, kv_heads, head_dim = k_cache.shape
    _need(q.dim() == 3, name, f"must be [tokens, q_heads, head_dim], got {list(q.shape)}")
    _need(
        q.dtype == k_cache.dtype, name, f"dtype {q.dtype} differs from the cache's {k_cache.dtype}"
    )
    _need(q.device == k_cache.device, name, f"is on {q.device}, the cache is on {k_cache.device}")
    _need(
        q.shape[2] == head_dim, name, f"head_dim {q.shape[2]} differs from the cache's {head_dim}"
    )
    _need(
        q.shape[1] % kv_heads == 0,
        name,
        f"q_heads {q.shape[1]} is not a multiple of kv_heads {kv_heads}",
    )
    _need(q.stride(2) == 1, name, "last dimension must be contiguous (stride 1)")
    return int(q.shape[0])


def _check_page_table(page_table: torch.Tensor, batch: int, device: torch.device) -> None:
    _need(page_table.dtype in INDEX_DTYPES, "page_table", f"must be int32, got {page_table.dtype}")
    _need(
        page_table.dim() == 2,
        "page_table",
        f"must be [max_seqs, max_pages_per_seq], got {list(page_table.shape)}",
    )
    _need(
        page_table.shape[0] >= batch,
        "page_table",
        f"has {page_table.shape[0]} rows for a batch of {batch}",
    )
    _need(page_table.stride(1) == 1, "page_table", "last dimension must be contiguous (stride 1)")
    _need(
        page_table.device == device,
        "page_table",
        f"is on {page_table.device}, the cache is on {device}",
    )


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> None:
    if out is None:
        return
    _need(out.shape == q.shape, "out", f"shape {list(out.shape)} differs from q {list(q.shape)}")
    _need(out.dtype == q.dtype and out.device == q.device, "out", "dtype and device must match q")
    _need(out.is_contiguous(), "out", "must be contiguous")


def _check_kv_lengths(
    lens_k: torch.Tensor, name: str, k_cache: torch.Tensor, page_table: torch.Tensor
) -> None:
    """Value check: every length fits its page-table row and every page it reads exists."""
    page_size, num_pages = int(k_cache.shape[1]), int(k_cache.shape[0])
    capacity = int(page_table.shape[1]) * page_size
    _need(
        bool((lens_k >= 1).all()), name, f"every length must be >= 1, got min {int(lens_k.min())}"
    )
    longest = int(lens_k.max())
    _need(
        longest <= capacity, name, f"length {longest} exceeds the page table's capacity {capacity}"
    )
    pages_used = (lens_k.to(torch.int64) + page_size - 1) // page_size
    columns = torch.arange(page_table.shape[1], device=lens_k.device)
    used = columns[None, :] < pages_used[:, None]
    ids = page_table[: lens_k.shape[0]][used]
    bad = (ids < 0) | (ids >= num_pages)
    _need(
        not bool(bad.any()),
        "page_table",
        f"page id {int(ids[bad][0]) if bad.any() else 0} is outside [0, {num_pages})",
    )


def check_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_values: bool,
) -> None:
    num_pages, page_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        _need(
            t.dim() == 3 and tuple(t.shape[1:]) == (kv_heads, head_dim),
            name,
            f"must be [tokens, {kv_heads}, {head_dim}], got {list(t.shape)}",
        )
        _need(
            t.dtype == k_cache.dtype,
            name,
            f"dtype {t.dtype} differs from the cache's {k_cache.dtype}",
        )
        _need(
            t.device == k_cache.device, name, f"is on {t.device}, the cache is on {k_cache.device}"
        )
        _need(t.stride(2) == 1, name, "last dimension must be contiguous (stride 1)")
    _need(v.shape[0] == k.shape[0], "v", f"has {v.shape[0]} tokens, k has {k.shape[0]}")
    _need(
        slot_mapping.dtype in SLOT_DTYPES,
        "slot_mapping",
        f"must be int32 or int64, got {slot_mapping.dtype}",
    )
    _need(
        slot_mapping.shape == (k.shape[0],),
        "slot_mapping",
        f"must have shape [{k.shape[0]}], got {list(slot_mapping.shape)}",
    )
    _need(
        slot_mapping.device == k_cache.device,
        "slot_mapping",
        f"is on {slot_mapping.device}, the cache on {k_cache.device}",
    )
    if not check_values or slot_mapping.numel() == 0:
        return
    slots = slot_mapping[slot_mapping >= 0]
    total = num_pages * page_size
    _need(
        bool((slots < total).all()),
        "slot_mapping",
        f"slot {int(slots.max()) if slots.numel() else 0} >= {total} slots in the cache",
    )
    _need(slots.unique().numel() == slots.numel(), "slot_mapping", "two tokens write the same slot")


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
    total_q = _check_query(q, k_cache)
    _need(
        cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 2,
        "cu_seqlens_q",
        f"must be [batch + 1] with batch >= 1, got {list(cu_seqlens_q.shape)}",
    )
    batch = int(cu_seqlens_q.shape[0]) - 1
    _check_index(cu_seqlens_q, "cu_seqlens_q", batch + 1, k_cache.device)
    _check_index(seq_lens_k, "seq_lens_k", batch, k_cache.device)
    _check_page_table(page_table, batch, k_cache.device)
    _check_out(out, q)
    if image_regions is not None:
        _need(
            image_regions.dtype in INDEX_DTYPES
            and image_regions.dim() == 2
            and image_regions.shape[1] == 3,
            "image_regions",
            "must be int32 [num_regions, 3] of (seq, start, end), "
            f"got {image_regions.dtype} {list(image_regions.shape)}",
        )
        _need(
            image_regions.device == k_cache.device,
            "image_regions",
            f"is on {image_regions.device}, the cache on {k_cache.device}",
        )
    if not check_values:
        return
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    _need(
        int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == total_q,
        "cu_seqlens_q",
        f"must run from 0 to q's {total_q} tokens, "
        f"got {int(cu_seqlens_q[0])}..{int(cu_seqlens_q[-1])}",
    )
    _need(
        bool((q_lens >= 1).all()), "cu_seqlens_q", "every query chunk must hold at least one token"
    )
    _need(
        bool((seq_lens_k >= q_lens).all()),
        "seq_lens_k",
        "every seq_len_k must be >= its query chunk length (the chunk's K/V is in the cache)",
    )
    _check_kv_lengths(seq_lens_k, "seq_lens_k", k_cache, page_table)
    if image_regions is not None:
        check_image_regions(image_regions, seq_lens_k)


def check_image_regions(image_regions: torch.Tensor, seq_lens_k: torch.Tensor) -> None:
    """Value check: 0 <= seq < batch, 0 <= start < end <= seq_len_k, no overlap in a sequence."""
    if image_regions.shape[0] == 0:
        return
    seq, start, end = (c.to(torch.int64) for c in image_regions.unbind(1))
    batch = seq_lens_k.shape[0]
    _need(
        bool(((seq >= 0) & (seq < batch)).all()),
        "image_regions",
        f"a sequence index is outside [0, {batch})",
    )
    _need(
        bool(((start >= 0) & (start < end)).all()),
        "image_regions",
        "every region needs 0 <= start < end",
    )
    _need(
        bool((end <= seq_lens_k.to(torch.int64)[seq]).all()),
        "image_regions",
        "a region ends past its sequence's seq_len_k",
    )
    order = torch.argsort(seq * (int(end.max()) + 1) + start)
    seq, start, end = seq[order], start[order], end[order]
    overlap = (seq[1:] == seq[:-1]) & (start[1:] < end[:-1])
    _need(not bool(overlap.any()), "image_regions", "two regions of one sequence overlap")


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
    batch = _check_query(q, k_cache)
    _need(batch >= 1, "q", "decode needs at least one sequence")
    _check_index(seq_lens, "seq_lens", batch, k_cache.device)
    _check_page_table(page_table, batch, k_cache.device)
    _check_out(out, q)
    if check_values:
        _check_kv_lengths(seq_lens, "seq_lens", k_cache, page_table)
