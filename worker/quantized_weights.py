"""Weight-only quantized matrices in one canonical form, before any backend packs them.

A linear layer's weight W [out, in] in a quantized format is kept as

    q       [out, in]         uint8 values 0..15 (int4) or int8 values -128..127 (int8)
    scales  [out, in / g]     float32, one per group of g consecutive inputs of a row
    zeros   [out, in / g]     float32

with W[o, i] = (q[o, i] - OFFSET) * scales[o, i // g] + zeros[o, i // g], OFFSET = 8 for int4
(torch's int4 CPU kernel, `aten._weight_int4pack_mm_for_cpu`, computes exactly this) and 0 for
int8. Both ways in produce this form: `quantize` from float weights (any checkpoint), and the
GGUF reader straight from llama.cpp's blocks (Q4_0: zeros 0; Q4_1: its min folded in as
zeros = m + 8 d; Q8_0: int8, zeros 0; group 32, no detour through float32). A backend then packs
it once, at load, for its kernel (worker/quantized_linear.py). `dequantize` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

WeightFormat = Literal["float32", "bf16", "int8", "int4"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("float32", "bf16", "int8", "int4")
QUANTIZED: tuple[WeightFormat, ...] = ("int8", "int4")
DEFAULT_GROUP = 32
OFFSET = {"int4": 8, "int8": 0}
LEVELS = {"int4": (0, 15), "int8": (-128, 127)}


@dataclass(frozen=True)
class QuantizedWeight:
    format: WeightFormat
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        if self.format not in QUANTIZED:
            raise ValueError(f"QuantizedWeight.format must be one of {QUANTIZED}: {self.format!r}")
        out, inp = self.q.shape
        groups = (out, inp // self.group_size)
        if inp % self.group_size or self.scales.shape != groups or self.zeros.shape != groups:
            raise ValueError(
                f"a {out}x{inp} {self.format} weight in groups of {self.group_size} needs scales "
                f"and zeros of {groups}, got {tuple(self.scales.shape)} and "
                f"{tuple(self.zeros.shape)}"
            )
        dtype = torch.uint8 if self.format == "int4" else torch.int8
        if self.q.dtype != dtype:
            raise ValueError(f"{self.format} values must be {dtype}, got {self.q.dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on `device` (itself when it is there already): the same values,
        not quantized again there (a GPU rounds some float32 scales one ulp away from a CPU)."""
        device = torch.device(device)
        if self.q.device == device:
            return self
        q, scales, zeros = (t.to(device) for t in (self.q, self.scales, self.zeros))
        return QuantizedWeight(self.format, q, scales, zeros, self.group_size)


def quantize(
    weight: torch.Tensor, fmt: WeightFormat, group_size: int = DEFAULT_GROUP
) -> QuantizedWeight:
    """Round-to-nearest per group: int4 asymmetric (the group's min and max map to 0 and 15),
    int8 symmetric (the group's largest magnitude maps to 127)."""
    if fmt not in QUANTIZED:
        raise ValueError(f"quantize makes {QUANTIZED}, not {fmt!r}")
    out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"{inp} inputs do not split into groups of {group_size}")
    w = weight.detach().float().reshape(out, inp // group_size, group_size)
    low, high = LEVELS[fmt]
    if fmt == "int4":
        lo, hi = w.amin(-1), w.amax(-1)
        scales = ((hi - lo) / (high - low)).clamp_min(1e-12)
        q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(low, high)
        zeros = lo + OFFSET[fmt] * scales  # (q - 8) * s + (lo + 8 s) = q * s + lo
        values = q.to(torch.uint8)
    else:
        scales = (w.abs().amax(-1) / high).clamp_min(1e-12)
        values = torch.round(w / scales[..., None]).clamp(low, high).to(torch.int8)
        zeros = torch.zeros_like(scales)
    return QuantizedWeight(fmt, values.reshape(out, inp), scales, zeros, group_size)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 matrix a quantized weight stands for (the reference every kernel matches)."""
    out, inp = weight.shape
    g = weight.group_size
    q = weight.q.float().reshape(out, inp // g, g) - OFFSET[weight.format]
    w = q * weight.scales[..., None] + weight.zeros[..., None]
    return w.reshape(out, inp)
