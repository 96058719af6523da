"""The int8 head's integer products through fbgemm: the same exact int32 sums `torch._int_mm`
gives, in about 60 % of its time at one row.

`int8_dynamic_matmul` (worker/quantized_linear.py) quantizes each row of x to int8 by its own
scale, sums the int8 products exactly in int32 and scales the sums in float32. Any kernel that
gives the exact sums gives the same logits, bit for bit. `torch._int_mm` (oneDNN, s8 x s8) took
3.4 ms for SmolLM2's 49,152 x 576 head at one row with the weight out of cache, 1.8 ms in cache
(2 threads, AVX-512 VNNI); fbgemm's int8 GEMM, which torch ships for its quantized linear layers,
2.0 and 0.7 ms. fbgemm's only entry that returns float32 is `quantized::linear_dynamic`, which
quantizes x itself: per tensor, asymmetric, to uint8, with scale (max - min) / 255 and zero point
-min / scale. Two sentinel columns make that quantization the identity on our int8 values: x is
passed as the float values of its int8 levels, with -128 and 127 appended to every row, and the
weight with two zero columns appended. Then min = -128 and max = 127 in any batch, the scale is
exactly 1 and the zero point 128, each level maps to itself plus 128, fbgemm subtracts 128 times
each weight row's sum, and the sentinels meet zero weights: the sums are the int8 products' sums,
times the weight row's scale (1 times it, exactly), and the row scales are applied after, as
`int8_dynamic_matmul` applies them. `prepack` checks that on a probe before it is used (fbgemm's
AVX2 kernels sum pairs of u8 x s8 products in int16, which saturates: there the probe fails and
the head keeps `_int_mm`).

It costs a second copy of the head's int8 weight in fbgemm's layout (28 MB for SmolLM2); torch
marks its quantized tensors deprecated, so anything missing or raising leaves `_int_mm`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

log = logging.getLogger(__name__)

SENTINELS = (-128.0, 127.0)
"""Appended to every row of x (against zero weight columns): the range fbgemm's quantization of
x then always sees, so that its scale is 1 and its zero point 128."""


def prepack(q: torch.Tensor, scales: torch.Tensor) -> Any | None:
    """q [out, in] int8 with per-row `scales` [out] in fbgemm's layout, or None where fbgemm is
    missing, raises, or does not give `torch._int_mm`'s sums exactly on a probe."""
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines or not hasattr(torch.ops.quantized, "linear_dynamic"):
        return None
    try:
        packed = _prepack(q, scales)
        extremes = _extremes(q.shape[1])
        exact = _exact(packed, q, scales) and _exact(_prepack(*extremes), *extremes)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        log.info("no fbgemm int8 head (%s): it keeps torch._int_mm", error)
        return None
    if not exact:
        log.info("fbgemm's int8 sums are not exact here: the int8 head keeps torch._int_mm")
        return None
    return packed


def packed_bytes(q: torch.Tensor) -> int:
    """About what `prepack` of q holds: its int8 values with the two zero columns, and a 32-bit
    column offset and scale a row (fbgemm pads the layout a little past this)."""
    rows, width = q.shape
    return rows * (width + len(SENTINELS)) + rows * 8


def scaled_sums(levels: torch.Tensor, packed: Any) -> torch.Tensor:
    """levels [rows, in] (float32 holding integers in [-127, 127]) times the packed weight's int8
    rows, summed exactly, times each weight row's scale: float32 [rows, out]."""
    ends = levels.new_tensor(SENTINELS).expand(levels.shape[0], len(SENTINELS))
    x = torch.cat([levels, ends], 1)
    out: torch.Tensor = torch.ops.quantized.linear_dynamic(x, packed, False)
    return out


def _prepack(q: torch.Tensor, scales: torch.Tensor) -> Any:
    padded = torch.cat([q, q.new_zeros(q.shape[0], len(SENTINELS))], 1)
    previous = torch.backends.quantized.engine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are marked deprecated
            weight = torch._make_per_channel_quantized_tensor(
                padded, scales.double(), torch.zeros(q.shape[0], dtype=torch.long), 0
            )
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(weight, None)
    finally:
        torch.backends.quantized.engine = previous


def _extremes(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A small weight whose rows are all 127, alternately -127 and 127, and random: with the
    probe's levels, the products an int16 pair sum would saturate on."""
    q = torch.randint(-127, 128, (3, width), generator=torch.Generator().manual_seed(1))
    q[0] = 127
    q[1, ::2], q[1, 1::2] = -127, 127
    return q.to(torch.int8), torch.tensor([1.0, 0.5, 0.25], dtype=torch.bfloat16)


def _exact(packed: Any, q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether fbgemm's scaled sums equal `_int_mm`'s on rows of random levels and of the
    extremes (every level 127; alternately -127 and 127), together and the last alone."""
    width = q.shape[1]
    levels = torch.randint(-127, 128, (3, width), generator=torch.Generator().manual_seed(0))
    levels[1] = 127
    levels[2, ::2], levels[2, 1::2] = -127, 127
    sums = torch._int_mm(levels.to(torch.int8), q.t() if width > 1 else q.t().contiguous())
    want = sums.float().mul_(scales)
    alone = scaled_sums(levels[2:].float(), packed)  # one row: a lone sequence's decode
    return torch.equal(scaled_sums(levels.float(), packed), want) and torch.equal(alone, want[2:])
