"""LoRA over segments of a flattened batch: shrink then expand (Punica / S-LoRA's SGMV).

Every row of a step's flat batch belongs to one adapter slot; rows of one slot are contiguous
(the engine orders sequences by slot), so the batch is cut into segments:

    x           [ a a a | b | - - | a ]        T rows (tokens) of `in` features
    seg_starts  [0, 3, 4, 6, 7]                 segment g owns rows seg_starts[g]:seg_starts[g+1]
    seg_slots   [2, 0, -1, 2]                   its slot in the stacked weights; -1: no adapter

    shrink:  h[rows]  = x[rows] @ a[slot].T     a: [slots, rank, in]   h: [T, rank]
    expand:  y[rows] += h[rows] @ b[slot].T     b: [slots, out, rank]  (scaling folded into b)

An adapter of a rank below the slots' rank is zero-padded, so every slot has the same shape.
A slot of -1 leaves its rows of `y` untouched (and its rows of `h` zero). This module holds the
plain-torch path (the CPU path and the oracle); imports nothing of ours.
"""

from __future__ import annotations

import torch


def segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, slot) of each non-empty segment, on the host."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    return [
        (starts[g], starts[g + 1], slots[g]) for g in range(len(slots)) if starts[g + 1] > starts[g]
    ]


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """h [T, rank] = x @ a[slot].T per segment (zero where the slot is -1), in x's dtype."""
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    for first, end, slot in segments(seg_starts, seg_slots):
        if slot >= 0:
            h[first:end] = x[first:end] @ a[slot].t()
    return h


def lora_expand_reference(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    """y[rows] += h[rows] @ b[slot].T per segment, in place (rows of slot -1 untouched)."""
    for first, end, slot in segments(seg_starts, seg_slots):
        if slot >= 0:
            y[first:end] += h[first:end] @ b[slot].t()


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """The serving path's shrink (see the module docstring)."""
    return lora_shrink_reference(x, a, seg_starts, seg_slots)


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    """The serving path's expand (see the module docstring)."""
    lora_expand_reference(y, h, b, seg_starts, seg_slots)
