"""Weight-only quantized matmul: y = x @ W.T with W kept as int4 or int8 and per-group scales.

    x        [M, K]            float16 / bfloat16 / float32 activations
    values   int4: [N, K/2] uint8, two weights a byte: column 2j in the low nibble, 2j+1 high
             int8: [N, K] int8
    scales   [N, K/G]          any float dtype, one per group of G consecutive inputs of a row
    zeros    [N, K/G] or None  (None: zero)
    W[n, k] = (q[n, k] - OFFSET) * scales[n, k // G] + zeros[n, k // G],  OFFSET 8 (int4), 0 (int8)
    y        [M, N]            x's dtype, accumulated in float32

The GPU path is a Triton kernel (kernels/triton_quant_matmul.py) that dequantizes each tile in
registers: decode reads the packed bytes, never a float copy of W, which is what makes it pay
(decode is memory-bound). `quant_matmul_reference` below dequantizes the whole matrix in float32
and multiplies: the oracle, and the path for any tensors Triton does not take (torch's own int4 /
int8 CPU kernels are worker/quantized_linear.py's CPU path; they need their own packing).

The public `quant_matmul` checks its arguments (each failure a KernelInputError naming the
argument) and runs the first backend that fits: triton for CUDA tensors when triton imports (or,
forced with backend="triton", CPU tensors under TRITON_INTERPRET=1), else the reference.
Imports nothing of ours outside kernels/, and triton only on first use.
"""

from __future__ import annotations

import os

import torch

from kernels.dispatch import optional_module
from kernels.errors import KernelInputError

FORMATS = ("int4", "int8")
OFFSET = {"int4": 8, "int8": 0}
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("triton", "reference")


def unpack_values(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """q [N, K]: the int4 nibbles unpacked (0..15, uint8), or the int8 values as they are."""
    if fmt == "int8":
        return values
    n, half = values.shape
    return torch.stack([values & 15, values >> 4], -1).reshape(n, 2 * half)


def dequantize_reference(
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group_size: int,
) -> torch.Tensor:
    """W [N, K] in float32 (module docstring)."""
    q = unpack_values(values, fmt)
    n, k = q.shape
    w = (q.float().reshape(n, k // group_size, group_size) - OFFSET[fmt]) * scales.float()[
        ..., None
    ]
    if zeros is not None:
        w = w + zeros.float()[..., None]
    return w.reshape(n, k)


def quant_matmul_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group_size: int,
) -> torch.Tensor:
    """x @ W.T in float32 from the dequantized W, returned in x's dtype."""
    w = dequantize_reference(values, scales, zeros, fmt, group_size)
    return (x.float() @ w.t()).to(x.dtype)


def check_quant_matmul(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group_size: int,
) -> None:
    """Shapes, dtypes and devices as the module docstring draws them (metadata only)."""
    if fmt not in FORMATS:
        raise KernelInputError("fmt", f"{fmt!r} is not one of {FORMATS}")
    if x.dim() != 2:
        raise KernelInputError("x", f"must be [rows, in], got shape {list(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise KernelInputError("x", f"dtype {x.dtype} is not one of {X_DTYPES}")
    k = x.shape[1]
    if group_size < 1 or k % group_size:
        raise KernelInputError("group_size", f"{group_size} does not divide x's {k} inputs")
    want = (torch.uint8, k // 2) if fmt == "int4" else (torch.int8, k)
    if values.dim() != 2 or values.dtype != want[0] or values.shape[1] != want[1]:
        raise KernelInputError(
            "values",
            f"{fmt} needs [out, {want[1]}] {want[0]} for {k} inputs, got "
            f"{list(values.shape)} {values.dtype}",
        )
    if fmt == "int4" and k % 2:
        raise KernelInputError("x", f"int4 packs two inputs a byte: {k} inputs is odd")
    _check_tables(x, values, scales, zeros, [values.shape[0], k // group_size])


def _check_tables(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    groups: list[int],
) -> None:
    """scales / zeros [N, K/G] floats; everything on x's device and contiguous."""
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            continue
        if list(t.shape) != groups:
            raise KernelInputError(name, f"must have shape {groups}, got {list(t.shape)}")
        if not t.is_floating_point():
            raise KernelInputError(name, f"must be floating point, got {t.dtype}")
    for name, t in (("values", values), ("scales", scales), ("zeros", zeros)):
        if t is not None and t.device != x.device:
            raise KernelInputError(name, f"is on {t.device}, x on {x.device}")
        if t is not None and not t.is_contiguous():
            raise KernelInputError(name, "must be contiguous")


def _triton_why_not(x: torch.Tensor, forced: bool) -> str | None:
    interpreting = forced and os.environ.get("TRITON_INTERPRET") == "1"
    if x.device.type != "cuda" and not interpreting:
        return "triton needs CUDA tensors (or backend='triton' under TRITON_INTERPRET=1)"
    if optional_module("kernels.triton_quant_matmul") is None:
        return "triton is not importable"
    return None


def choose_quant_matmul_backend(x: torch.Tensor, backend: str | None = None) -> str:
    """`backend` if given and able (else KernelInputError("backend")); by default triton when it
    can run x, else the reference."""
    if backend is not None and backend not in BACKENDS:
        raise KernelInputError("backend", f"{backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return backend
    why = _triton_why_not(x, forced=backend is not None)
    if why is None:
        return "triton"
    if backend is not None:
        raise KernelInputError("backend", f"'triton' cannot run this call: {why}")
    return "reference"


def quant_matmul(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fmt: str,
    group_size: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y [M, N] = x @ W.T in x's dtype (module docstring)."""
    check_quant_matmul(x, values, scales, zeros, fmt, group_size)
    if choose_quant_matmul_backend(x, backend) == "reference":
        return quant_matmul_reference(x, values, scales, zeros, fmt, group_size)
    module = optional_module("kernels.triton_quant_matmul")
    assert module is not None
    y: torch.Tensor = module.quant_matmul(x, values, scales, zeros, fmt, group_size)
    return y
