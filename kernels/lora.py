"""LoRA over segments of a flattened batch: shrink then expand (Punica / S-LoRA's SGMV).

Every row of a step's flat batch belongs to one adapter slot; rows of one slot are contiguous
(the engine orders sequences by slot), so the batch is cut into segments:

    x           [ a a a | b | - - | a ]        T rows (tokens) of `in` features
    seg_starts  [0, 3, 4, 6, 7]                 segment g owns rows seg_starts[g]:seg_starts[g+1]
    seg_slots   [2, 0, -1, 2]                   its slot in the stacked weights; -1: no adapter

    shrink:  h[rows]  = x[rows] @ a[slot].T     a: [slots, rank, in]   h: [T, rank]
    expand:  y[rows] += h[rows] @ b[slot].T     b: [slots, out, rank]  (scaling folded into b)

An adapter of a rank below the slots' rank is zero-padded, so every slot has the same shape.
A slot of -1 leaves its rows of `y` untouched (and its rows of `h` zero). Segments may be empty;
seg_starts runs from 0 to T without decreasing (int32 or int64, like seg_slots).

The public `lora_shrink` / `lora_expand` check their arguments (kernels/validate_lora.py) and run
the first backend that fits:

    triton      CUDA tensors, fp16 / bf16 / fp32, triton importable   (kernels/triton_lora.py)
    torch       any tensors: a matmul per segment; the CPU path        (kernels/torch_lora.py)
    reference   the loops below: the test oracle

`backend="name"` forces one; a forced triton also runs CPU tensors when TRITON_INTERPRET=1 was set
before triton was imported. Triton is imported on first use, so the CPU path never imports it.
`check_values=False` skips the checks that read seg_starts / seg_slots (a synchronisation on
CUDA): a caller that makes the same call once per layer checks the first and skips the rest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kernels import validate_lora
from kernels.dispatch import optional_module
from kernels.errors import KernelInputError

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LORA_BACKENDS = ("triton", "torch", "reference")


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


REFERENCE: dict[str, Callable[..., Any]] = {
    "lora_shrink": lora_shrink_reference,
    "lora_expand": lora_expand_reference,
}


def _why_not(backend: str, device: torch.device, dtype: torch.dtype, forced: bool) -> str | None:
    """Why `backend` cannot run tensors of this device and dtype (None: it can)."""
    if backend != "triton":
        return None
    interpreting = forced and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreting:
        return "triton needs CUDA tensors (or backend='triton' under TRITON_INTERPRET=1)"
    if dtype not in TRITON_DTYPES:
        return f"the triton kernels take {TRITON_DTYPES}, not {dtype}"
    if optional_module("kernels.triton_lora") is None:
        return "triton is not importable"
    return None


def choose_lora_backend(rows: torch.Tensor, backend: str | None = None) -> str:
    """The backend that runs LoRA on tensors like `rows` (x or y): `backend` if given and able,
    else the first of LORA_BACKENDS that fits. Raises KernelInputError("backend") otherwise."""
    if backend is not None and backend not in LORA_BACKENDS:
        raise KernelInputError("backend", f"{backend!r} is not one of {LORA_BACKENDS}")
    for name in LORA_BACKENDS if backend is None else (backend,):
        why = _why_not(name, rows.device, rows.dtype, forced=backend is not None)
        if why is None:
            return name
        if backend is not None:
            raise KernelInputError("backend", f"{backend!r} cannot run this call: {why}")
    raise AssertionError("the reference backend always fits")


def _implementation(backend: str, operation: str) -> Callable[..., Any]:
    if backend == "reference":
        return REFERENCE[operation]
    module = optional_module(f"kernels.{backend}_lora")
    assert module is not None, f"backend {backend} was chosen but cannot be imported"
    function: Callable[..., Any] = getattr(module, operation)
    return function


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    check_values: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """h [T, rank] = x @ a[slot].T per segment, zeros where the slot is -1 (module docstring).

    x [T, in], a [slots, rank, in] of x's dtype; returns a new h in x's dtype.
    """
    validate_lora.check_shrink(x, a, seg_starts, seg_slots, check_values)
    name = choose_lora_backend(x, backend)
    h: torch.Tensor = _implementation(name, "lora_shrink")(x, a, seg_starts, seg_slots)
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    check_values: bool = True,
    backend: str | None = None,
) -> None:
    """y[rows] += h[rows] @ b[slot].T per segment, in place; rows of slot -1 untouched.

    y [T, out] (any strides: a column slice of a fused projection is fine), h [T, rank],
    b [slots, out, rank], all of y's dtype.
    """
    validate_lora.check_expand(y, h, b, seg_starts, seg_slots, check_values)
    name = choose_lora_backend(y, backend)
    _implementation(name, "lora_expand")(y, h, b, seg_starts, seg_slots)
