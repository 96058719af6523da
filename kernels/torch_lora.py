"""The CPU serving path of LoRA shrink / expand: one in-place matmul per segment, nothing else.

On a CPU a small matmul costs microseconds of call overhead, not FLOPs, so the fastest form is
the one with the fewest torch calls: the rows are cut into per-segment views with one `split`,
the slots' transposed weights into views with one `unbind`, and each non-empty segment of a
real slot is one `torch.mm(..., out=)` (shrink) or `addmm_` (expand) into those views. A batch
that is one segment is one call. docs/kernels.md has the measurements that chose this over
gathering per-row weights for `bmm` (2-20x slower: the gather copies rank x features per row) and
over one matmul against every slot followed by a gather (slower at every measured shape).

Works on any device (on CUDA it reads the segments to the host: a synchronisation). Never
validates (kernels/lora.py does).
"""

from __future__ import annotations

import itertools

import torch


def _lengths(starts: list[int]) -> list[int]:
    return [end - first for first, end in itertools.pairwise(starts)]


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """h [T, rank] = x @ a[slot].T per segment (zeros where the slot is -1), in x's dtype."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    if len(slots) == 1 and slots[0] >= 0:
        return torch.mm(x, a[slots[0]].t())
    shape = (x.shape[0], a.shape[1])
    h = x.new_empty(shape) if slots and min(slots) >= 0 else x.new_zeros(shape)
    weights = a.transpose(1, 2).unbind(0)
    lengths = _lengths(starts)
    for rows, out, slot in zip(x.split(lengths), h.split(lengths), slots, strict=True):
        if slot >= 0 and rows.shape[0]:
            torch.mm(rows, weights[slot], out=out)
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    """y[rows] += h[rows] @ b[slot].T per segment, in place (rows of slot -1 untouched)."""
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    weights = b.transpose(1, 2).unbind(0)
    if len(slots) == 1 and slots[0] >= 0:
        y.addmm_(h, weights[slots[0]])
        return
    lengths = _lengths(starts)
    for out, rows, slot in zip(y.split(lengths), h.split(lengths), slots, strict=True):
        if slot >= 0 and rows.shape[0]:
            out.addmm_(rows, weights[slot])
