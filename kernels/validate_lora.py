"""Argument checks for lora_shrink and lora_expand, run by kernels/lora.py before any backend.

Structural checks (rank, shape, dtype, device) read metadata only and always run. The value
checks read seg_starts and seg_slots (two small host copies: free on the CPU, a synchronisation
on CUDA), so they run only with `check_values=True`. Every failure is a `KernelInputError` naming
the argument as it appears in the signature. Never mutates anything.
"""

from __future__ import annotations

import torch

from kernels.errors import KernelInputError

LORA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_matrix(
    t: torch.Tensor, name: str, dims: int, like: torch.Tensor, like_name: str
) -> None:
    """`dims` dimensions, the dtype and device of `like` (the first operand)."""
    if t.dim() != dims:
        raise KernelInputError(name, f"must have {dims} dimensions, got shape {list(t.shape)}")
    if t.dtype != like.dtype:
        raise KernelInputError(name, f"dtype {t.dtype} differs from {like_name}'s {like.dtype}")
    if t.device != like.device:
        raise KernelInputError(name, f"is on {t.device}, {like_name} on {like.device}")


def _check_segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor, rows: torch.Tensor) -> None:
    for name, t in (("seg_starts", seg_starts), ("seg_slots", seg_slots)):
        if t.dtype not in INDEX_DTYPES:
            raise KernelInputError(name, f"must be int32 or int64, got {t.dtype}")
        if t.dim() != 1:
            raise KernelInputError(name, f"must be 1-D, got shape {list(t.shape)}")
        if t.device != rows.device:
            raise KernelInputError(name, f"is on {t.device}, the rows on {rows.device}")
    if seg_starts.shape[0] < 1:
        raise KernelInputError("seg_starts", "must hold at least one entry (0)")
    if seg_slots.shape[0] != seg_starts.shape[0] - 1:
        raise KernelInputError(
            "seg_slots",
            f"has {seg_slots.shape[0]} entries for {seg_starts.shape[0] - 1} segments "
            f"(seg_starts has {seg_starts.shape[0]})",
        )


def check_segment_values(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor, rows: int, slots: int
) -> None:
    """seg_starts runs from 0 to `rows` without decreasing; every slot is -1 or in [0, slots)."""
    starts, slot_list = seg_starts.tolist(), seg_slots.tolist()
    if starts[0] != 0 or starts[-1] != rows:
        raise KernelInputError(
            "seg_starts", f"runs {starts[0]}..{starts[-1]}, not 0..{rows} (the batch's rows)"
        )
    if starts != sorted(starts):
        raise KernelInputError("seg_starts", f"must not decrease: {starts}")
    if slot_list and (min(slot_list) < -1 or max(slot_list) >= slots):
        raise KernelInputError(
            "seg_slots", f"every slot must be -1 or in [0, {slots}), got {slot_list}"
        )


def check_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    check_values: bool,
) -> None:
    """x [T, in], a [slots, rank, in] of x's dtype and device; segments over x's T rows."""
    if x.dim() != 2:
        raise KernelInputError("x", f"must be [rows, in], got shape {list(x.shape)}")
    if x.dtype not in LORA_DTYPES:
        raise KernelInputError("x", f"dtype {x.dtype} is not one of {LORA_DTYPES}")
    _check_matrix(a, "a", 3, x, "x")
    if a.shape[2] != x.shape[1]:
        raise KernelInputError(
            "a", f"has {a.shape[2]} input features (shape {list(a.shape)}), x has {x.shape[1]}"
        )
    _check_segments(seg_starts, seg_slots, x)
    if check_values:
        check_segment_values(seg_starts, seg_slots, x.shape[0], a.shape[0])


def check_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    check_values: bool,
) -> None:
    """y [T, out], h [T, rank], b [slots, out, rank] of y's dtype and device."""
    if y.dim() != 2:
        raise KernelInputError("y", f"must be [rows, out], got shape {list(y.shape)}")
    if y.dtype not in LORA_DTYPES:
        raise KernelInputError("y", f"dtype {y.dtype} is not one of {LORA_DTYPES}")
    _check_matrix(h, "h", 2, y, "y")
    _check_matrix(b, "b", 3, y, "y")
    if h.shape[0] != y.shape[0]:
        raise KernelInputError("h", f"has {h.shape[0]} rows, y has {y.shape[0]}")
    if b.shape[1] != y.shape[1]:
        raise KernelInputError(
            "b", f"has {b.shape[1]} output features (shape {list(b.shape)}), y has {y.shape[1]}"
        )
    if b.shape[2] != h.shape[1]:
        raise KernelInputError(
            "b", f"has rank {b.shape[2]} (shape {list(b.shape)}), h has {h.shape[1]}"
        )
    _check_segments(seg_starts, seg_slots, y)
    if check_values:
        check_segment_values(seg_starts, seg_slots, y.shape[0], b.shape[0])
