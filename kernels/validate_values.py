"""Checks that read tensor contents: lengths, page ids, slots, image regions.

Free on the CPU; on CUDA each one synchronises with the device, which is why dispatch runs them
only when asked (`check_values=True`, the default). They assume the structural checks of
kernels/validate.py passed. Every failure is a `KernelInputError` naming the argument and the
offending number. Never mutates anything.
"""

from __future__ import annotations

import torch

from kernels.errors import KernelInputError


def check_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Non-negative slots lie inside the cache and are unique (negative ones are padding)."""
    slots = slot_mapping[slot_mapping >= 0]
    total = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= total:
        raise KernelInputError("slot_mapping", f"slot {int(slots.max())} >= the cache's {total}")
    if slots.unique().numel() != slots.numel():
        raise KernelInputError("slot_mapping", "two tokens write the same slot")


def check_chunks(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, total_q: int) -> None:
    """cu_seqlens_q runs from 0 to total_q; every chunk holds 1 .. seq_len_k tokens."""
    first, last = int(cu_seqlens_q[0]), int(cu_seqlens_q[-1])
    if first != 0 or last != total_q:
        raise KernelInputError(
            "cu_seqlens_q", f"runs {first}..{last}, not 0..{total_q} (q's tokens)"
        )
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if bool((q_lens < 1).any()):
        raise KernelInputError("cu_seqlens_q", f"a query chunk is empty: lengths {q_lens.tolist()}")
    if bool((seq_lens_k < q_lens).any()):
        raise KernelInputError(
            "seq_lens_k", "shorter than its query chunk: write the chunk's K/V first"
        )


def check_kv_lengths(
    lens: torch.Tensor, name: str, k_cache: torch.Tensor, page_table: torch.Tensor
) -> None:
    """Every length is >= 1 and fits its page-table row; every page it reads exists."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    capacity = page_table.shape[1] * page_size
    shortest, longest = int(lens.min()), int(lens.max())
    if shortest < 1:
        raise KernelInputError(name, f"every length must be >= 1, got {shortest}")
    if longest > capacity:
        raise KernelInputError(name, f"length {longest} exceeds the page table's {capacity}")
    pages_used = (lens.to(torch.int64) + page_size - 1) // page_size
    columns = torch.arange(page_table.shape[1], device=lens.device)
    ids = page_table[: lens.shape[0]][columns[None, :] < pages_used[:, None]]
    bad = ids[(ids < 0) | (ids >= num_pages)]
    if bad.numel():
        raise KernelInputError("page_table", f"page id {int(bad[0])} is outside [0, {num_pages})")


def check_image_regions(image_regions: torch.Tensor, seq_lens_k: torch.Tensor) -> None:
    """0 <= seq < batch, 0 <= start < end <= seq_len_k, no two regions of a sequence overlap."""
    if image_regions.shape[0] == 0:
        return
    seq, start, end = (c.to(torch.int64) for c in image_regions.unbind(1))
    batch = seq_lens_k.shape[0]
    if bool(((seq < 0) | (seq >= batch)).any()):
        raise KernelInputError("image_regions", f"a sequence index is outside [0, {batch})")
    if bool(((start < 0) | (start >= end)).any()):
        raise KernelInputError("image_regions", "every region needs 0 <= start < end")
    if bool((end > seq_lens_k.to(torch.int64)[seq]).any()):
        raise KernelInputError("image_regions", "a region ends past its sequence's seq_len_k")
    order = torch.argsort(seq * (int(end.max()) + 1) + start)
    seq, start, end = seq[order], start[order], end[order]
    if bool(((seq[1:] == seq[:-1]) & (start[1:] < end[:-1])).any()):
        raise KernelInputError("image_regions", "two regions of one sequence overlap")
