"""`QuantizedLinear`: a drop-in for `nn.Linear` whose weight stays in bf16, int8 or int4 form.

Decode is memory-bound: each token reads every weight once, so the bytes of the weights set the
speed. This module keeps a linear layer's weight in a smaller form and multiplies without ever
materialising the float32 matrix. The same in_features / out_features / bias as the nn.Linear
it replaces; `forward(x)` takes [..., in] in any float dtype and returns [..., out] in x's
dtype (activations stay in the model's dtype; only the weight is smaller).

A layer is packed once, for the device its weight is on, into one of these layouts:

    format  device  buffers                                        multiply
    bf16    any     weight [out, in] bf16                          F.linear in bf16
    int4    cpu     packed [out, in/2] uint8 (torch's int4pack),   aten._weight_int4pack_mm_for_cpu
                    scales_and_zeros [in/g, out, 2] bf16
    int4    cuda    packed [out, in/2] uint8 (low nibble: even     kernels.quant_matmul (Triton,
                    column), scales / zeros [out, in/g] bf16       dequantizes in registers)
    int8    cpu     q [out, in] int8, scales [out] bf16            aten._weight_int8pack_mm
    int8    cuda    the same                                       kernels.quant_matmul

int4: W[o, i] = (q[o, i] - 8) * scales[o, i // g] + zeros[o, i // g] (worker/quantized_weights.py)
in groups of g = 32 inputs, scales and zeros rounded to bf16 (the form torch's CPU int4 kernel
requires). int8: symmetric per output channel, W[o, i] = q[o, i] * scales[o] (torchao's and
gpt-fast's int8 weight-only form, and the one `_weight_int8pack_mm` takes): a grouped int8
weight (GGUF Q8_0) is dequantized and quantized again per channel. Every device stores the same
values, so `reference_weight()` is the one matrix every path computes with. Activations are cast
to bf16 for the multiply (the CPU kernels take bf16; the product is rounded to bf16 and cast back
to x's dtype). Moving a packed layer to another device
is refused at its first forward (pack it again on the new device: worker/weight_formats.py does
the packing after the model is placed).

Measured (2 threads on a shared 2-core AMD EPYC with AVX2, no AVX-512 / AMX; medians of
alternating runs, torch 2.13): see MEASURED below; the choices follow from it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker.quantized_weights import OFFSET, QuantizedWeight, quantize

LinearFormat = Literal["bf16", "int8", "int4"]
INT4_CPU_ROWS = 16
"""torch's CPU int4pack takes a multiple of 16 output rows: others are padded (level 8, scale 0,
zero 0: weights of 0) and the padding's outputs cut off."""
LINEAR_FORMATS: tuple[LinearFormat, ...] = ("bf16", "int8", "int4")
MEASURED = """(filled in from benchmarks/linear_formats_bench.py)"""


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held as bf16, or int8 / int4 with per-group scales."""

    weight: torch.Tensor
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor | QuantizedWeight,
        fmt: LinearFormat,
        bias: torch.Tensor | None = None,
        group_size: int = 32,
    ) -> None:
        """Pack `weight` ([out, in] float, or an already quantized one) as `fmt` for the device
        it is on. A float weight is quantized round-to-nearest (int4 in groups of `group_size`);
        a QuantizedWeight is packed as it is for int4 (it must be int4), quantized again per
        channel for int8, dequantized for bf16."""
        super().__init__()
        if fmt not in LINEAR_FORMATS:
            raise ValueError(f"QuantizedLinear format must be one of {LINEAR_FORMATS}: {fmt!r}")
        if isinstance(weight, QuantizedWeight):
            if fmt == "int4" and weight.format != "int4":
                raise ValueError(f"a {weight.format} QuantizedWeight cannot be packed as int4")
            device = weight.q.device
        else:
            if weight.dim() != 2:
                raise ValueError(f"weight must be [out, in], got shape {list(weight.shape)}")
            device = weight.device
        self.out_features, self.in_features = (int(d) for d in _shape(weight))
        self.format: LinearFormat = fmt
        self.device_type = device.type
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        if fmt == "bf16":
            self.group_size = 0
            self.register_buffer("weight", _float(weight).to(torch.bfloat16).contiguous())
            return
        if fmt == "int8":  # per output channel (module docstring)
            float_weight = _float(weight)
            qw = quantize(float_weight, "int8", self.in_features)
        elif isinstance(weight, QuantizedWeight):
            qw = weight
        else:
            qw = quantize(weight, "int4", group_size)
        self.group_size = qw.group_size
        scales, zeros = qw.scales.to(torch.bfloat16), qw.zeros.to(torch.bfloat16)
        if fmt == "int8":
            self.register_buffer("q", qw.q.contiguous())
            self.register_buffer("scales", scales.reshape(-1).contiguous())
        elif device.type == "cpu":
            pad = -self.out_features % INT4_CPU_ROWS  # the kernel takes whole blocks of rows
            q = nn.functional.pad(qw.q, (0, 0, 0, pad), value=OFFSET["int4"])
            scales, zeros = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (scales, zeros))
            self.register_buffer("packed", pack_int4_cpu(q))
            self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], -1))
        else:
            self.register_buffer("packed", pack_nibbles(qw.q))
            self.register_buffer("scales", scales.contiguous())
            self.register_buffer("zeros", zeros.contiguous())

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: LinearFormat, group_size: int = 32
    ) -> QuantizedLinear:
        return cls(linear.weight.detach(), fmt, linear.bias, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != self.device_type:
            raise RuntimeError(
                f"this {self.format} layer was packed for {self.device_type}, called on "
                f"{x.device.type} tensors: apply the weight format after moving the model"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self._matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "bf16":
            return F.linear(x.to(torch.bfloat16), self.weight)
        if self.device_type == "cpu":
            if self.format == "int8":
                return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales)
            y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
            )
            return y if y.shape[1] == self.out_features else y[:, : self.out_features]
        from kernels.quant_matmul import quant_matmul  # noqa: PLC0415 - triton only on GPU

        if self.format == "int8":
            return quant_matmul(x, self.q, self.scales[:, None], None, "int8", self.in_features)
        return quant_matmul(x, self.packed, self.scales, self.zeros, "int4", self.group_size)

    def reference_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] matrix this layer multiplies by, dequantized in `dtype` (the reference
        every path is tested against; the CPU int8 and prefill paths multiply by it)."""
        if self.format == "bf16":
            return self.weight.to(dtype)
        out, inp, g = self.out_features, self.in_features, self.group_size
        if self.format == "int8":
            return self.q.to(dtype) * self.scales[:, None].to(dtype)
        if self.device_type == "cpu":
            q = unpack_int4_cpu(self.packed, inp)[:out]
            scales = self.scales_and_zeros[:, :out, 0].t()
            zeros = self.scales_and_zeros[:, :out, 1].t()
        else:
            q, scales, zeros = unpack_nibbles(self.packed), self.scales, self.zeros
        w = (q.reshape(out, inp // g, g).to(dtype) - OFFSET["int4"]) * scales[..., None].to(dtype)
        return (w + zeros[..., None].to(dtype)).reshape(out, inp)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (values + scales + zeros + bias)."""
        return sum(t.nbytes for t in self.buffers()) + sum(p.nbytes for p in self.parameters())

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}{group}, "
            f"device={self.device_type}"
        )


def _shape(weight: torch.Tensor | QuantizedWeight) -> tuple[int, int]:
    if isinstance(weight, QuantizedWeight):
        return weight.shape
    return int(weight.shape[0]), int(weight.shape[1])


def _float(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        from worker.quantized_weights import dequantize  # noqa: PLC0415

        return dequantize(weight)
    return weight.detach()


def pack_int4_cpu(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] uint8 0..15 -> torch's CPU int4pack layout ([out, in/2] uint8)."""
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    return packed


def unpack_int4_cpu(packed: torch.Tensor, inp: int) -> torch.Tensor:
    """The values 0..15 [rows, in] of a CPU int4pack tensor, recovered by multiplying the
    identity (exact: one weight per output, scale 1, zero 8 cancels OFFSET)."""
    out = packed.shape[0]
    eye = torch.eye(inp, dtype=torch.bfloat16)
    ones = torch.stack([torch.ones(inp // 32, out), torch.full((inp // 32, out), 8.0)], -1).to(
        torch.bfloat16
    )
    values = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, ones)
    return values.t().round().to(torch.uint8)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] uint8 0..15 -> [out, in/2] uint8: column 2j in the low nibble, 2j+1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    return torch.stack([packed & 15, packed >> 4], -1).reshape(out, 2 * half)
