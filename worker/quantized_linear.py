"""`QuantizedLinear`: a drop-in for `nn.Linear` whose weight stays in bf16, int8 or int4 form.

Decode is memory-bound: each token reads every weight once, so the bytes of the weights set the
speed. This module keeps a linear layer's weight in a smaller form and multiplies without ever
materialising the float32 matrix. The same in_features / out_features / bias as the nn.Linear
it replaces; `forward(x)` takes [..., in] in any float dtype and returns [..., out] in x's
dtype (activations stay in the model's dtype; only the weight is smaller).

A layer is packed once, for the device its weight is on (`triton`: CUDA), into one of these
layouts:

    format  device  buffers                                        multiply (decode)
    bf16    any     weight [out, in] bf16                          F.linear in bf16
    int4    cpu     packed [out', in/2] uint8 (torch's int4pack,   aten._weight_int4pack_mm_for_cpu
                    out' = out padded to 64), scales_and_zeros
                    [in/g, out', 2] bf16
    int4    cuda    packed [out, in/2] uint8 (low nibble: even     kernels.quant_matmul (Triton,
                    column), scales / zeros [out, in/g] bf16       dequantizes in registers)
    int8    cpu     q [out, in] int8, scales [out] bf16            aten._weight_int8pack_mm (a
                                                                   head with int8 dot products:
                                                                   int8_dynamic_matmul)
    int8    cuda    the same                                       kernels.quant_matmul

On the CPU, a call of FLOAT32_ROWS rows or more (a prefill chunk) dequantizes the weight to
float32 for that call and runs float32 GEMM instead (`float32_matmul`) where that is the faster,
and no float copy is kept: int8 always, bf16 on a CPU without AVX512-BF16, int4 under torch's
AVX2 kernels (FLOAT32_ROWS).

int4: W[o, i] = (q[o, i] - 8) * scales[o, i // g] + zeros[o, i // g] (worker/quantized_weights.py)
in groups of g = 32 inputs, scales and zeros rounded to bf16 (the form torch's CPU int4 kernel
requires). int8: symmetric per output channel, W[o, i] = q[o, i] * scales[o] (torchao's and
gpt-fast's int8 weight-only form, and the one `_weight_int8pack_mm` takes): a grouped int8
weight (GGUF Q8_0) is dequantized and quantized again per channel. Every device stores the same
values, so `reference_weight()` is the one matrix every path computes with. Activations are cast
to bf16 for the multiply (the CPU kernels take bf16; the product is rounded to bf16 and cast back
to x's dtype), except by an int8 head on a CPU with int8 dot products, which quantizes them to
int8 per row and gives float32 logits (`int8_dynamic_matmul`). Moving a packed layer to another
device is refused at its first forward (pack it again on the new device:
worker/weight_formats.py does the packing after the model is placed).

Measured (benchmarks/linear_formats_bench.py; a 2-core AMD EPYC VM, AVX2, no AVX-512 / AMX,
32 MB L3, shared with other jobs at a load of 2-5; torch 2.13; 1 thread, because at 2 threads
the other jobs made every parallel op wait for a time slice: a float32 decode step took 284 ms
at 2 threads against 75 ms at 1; each candidate cycles through 128 MB of copies so that weights
come from memory as in decode; medians of 5 alternating rounds, ms):

    candidate                 head 49152x576      mlp 1536x576
                              1 token  256        1 token  256
    float32 F.linear           17.7    283        0.36     6.0
    bf16 F.linear              10.5   1778        0.24    48.2
    bf16 -> float32, GEMM     134.1    368        0.31     6.3
    int4 kernel (int4pack)      6.7    462        0.15    12.8
    int4 -> bf16, bf16 mm     279.5   2043        1.31    49.5
    int4 -> float32, GEMM     505.9    782        0.82     7.2
    int8 kernel (int8pack)     10.5    756        0.21    11.6
    int8 kernel, float32 x     43.6  11124        0.91   245
    int8 -> bf16, mm, scale    71.8   1937        0.40    49.9
    int8 -> float32, GEMM     250.0    558        0.39     7.2
    int8 grouped -> bf16, mm  282.2   2152        1.44    50.9

So decode (one row) takes each format's kernel, and from FLOAT32_ROWS rows on a CPU layer
dequantizes to float32 and runs float32 GEMM (bf16: from 8 rows on a CPU without AVX512-BF16,
like this one, never with it; int8: from 64; int4: from 64 with torch's AVX2 kernels, as this
table shows, never with its AVX-512 ones, which a later host runs: FLOAT32_ROWS). Whole
SmolLM2-135M (head bf16, worker/weight_formats.py), one thread, same conditions, one run
alternating the formats (a decode step at 128 tokens of context / a cold 256-token prefill,
with the decode kernel alone in brackets): float32 70.8 ms / 869 ms; bf16 61.5 / 1117 (6042);
int8 55.0 / 1283 (1709); int4 48.4 / 1286 (1847). Per decode step the linears took float32
48.9 ms (538 MB read: 11 GB/s), bf16 34.6, int8 30.7 (134 MB: the int8 kernel is
compute-bound on AVX2, 4.4 GB/s), int4 21.5 (84 MB, its head int4 then) (torch profiler); the
rest of a step is the same in every format. At 2 threads (OMP_WAIT_POLICY=PASSIVE) the same
machine gave float32 86.8 ms and int4 65.9 ms a step, slower than 1 thread: remeasure on a quiet
machine before reading 2-thread speed-ups off these.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from worker import fbgemm_int8
from worker.quantized_weights import OFFSET, QuantizedWeight, quantize

LinearFormat = Literal["bf16", "int8", "int4"]
INT4_CPU_ROWS = 64
"""torch's CPU int4pack lays rows out in blocks of 64 (AVX-512) or 32 (AVX2, scalar), a last
partial block differently: rows are padded to a multiple of 64 (level 8, scale 0, zero 0:
weights of 0; the padding's outputs are cut off), so every block has the one layout that
`int4pack_layout` finds."""
LINEAR_FORMATS: tuple[LinearFormat, ...] = ("bf16", "int8", "int4")
HEAD_FLOAT32_ROWS = 32
"""The output head's FLOAT32_ROWS where its format's kernel is not the faster at every row count
(`head_float32_rows`): its float32 path dequantizes a 49,152 x 576 table (113 MB in float32)
each call, 68-112 ms on an AVX2 CPU for 1-64 rows, while the bf16 kernel there costs about
3.5 ms a row; they cross between 24 and 32 rows (2 threads). With the projections' 4, a batch
of 4 decodes spent 88 ms a step on the head instead of 14."""
HEAD_EXACT_TOP = 64
"""Logits the head recomputes exactly in float32 after its bf16 kernel: the top ones by the
kernel's. The kernel rounds its output to bf16, whose step at a logit of 25 is 0.125: SmolLM2's
first answer token to "What is the capital of France?" ("The" 25.325 against "L" 25.243 in
float32) became a tie at 25.0 and greedy decoding answered "L'Etoile, ...". The true maximum is
within one rounding step of the kernel's, so it is always among these. An int8 head with int8
dot products (`int8_dynamic_matmul`) errs by its activations' rounding instead, which only
bounds the error loosely (half a step times a row's sum of |w|: 7 logits at the median row of
SmolLM2's held-in text, 20 at most): there the true maximum being among these is measured, not
proven. Over 768 positions of that text it ranked within the kernel's top 3 every time (largest
error 1.84 logits), and the greedy tokens were those of the exact logits at every position;
the logits outside the top are noisier than the bf16 kernel's (mean KL from the exact
distribution 5e-4 nats against 1.4e-5), which sampling sees and greedy decoding does not."""
EXACT_ROWS_PER_PASS = 64
"""Rows whose top logits `exact_top_logits` recomputes at once: their weight rows in float32 take
64 x 64 x in x 4 bytes (9.4 MB for SmolLM2), where 256 rows at once (38 MB, and its product as
big again) took 12-16 ms against 1-2 ms in passes of 64."""
KERNEL_ONLY = sys.maxsize
"""The FLOAT32_ROWS of a format whose kernel is the faster at every row count."""


def int4_float32_rows(capability: str) -> int:
    """int4's FLOAT32_ROWS under torch's CPU kernels of `capability`
    (`torch.backends.cpu.get_cpu_capability()`): its kernel at every row count with the AVX-512
    kernels, from 64 rows otherwise (FLOAT32_ROWS says why)."""
    return KERNEL_ONLY if capability == "AVX512" else 64


def bf16_float32_rows(avx512_bf16: bool) -> int:
    """bf16's FLOAT32_ROWS on a CPU with or without AVX512-BF16 (native bf16 dot products, which
    torch's bf16 matmul then uses through oneDNN): its kernel at every row count with them, from
    8 rows without (FLOAT32_ROWS says why)."""
    return KERNEL_ONLY if avx512_bf16 else 8


def _has_avx512_bf16() -> bool:
    """Whether the CPU has AVX512-BF16 and torch multiplies bf16 through oneDNN, which uses it."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # private; absent: assume not
    onednn = bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    return probe is not None and bool(probe()) and onednn


FLOAT32_ROWS: dict[str, int] = {
    "bf16": bf16_float32_rows(_has_avx512_bf16()),
    "int8": 64,
    "int4": int4_float32_rows(torch.backends.cpu.get_cpu_capability()),
}
"""From this many rows on (prefill chunks, big decode batches), a CPU layer dequantizes its
weight to float32 and runs float32 GEMM instead of its decode kernel (module docstring): no
bf16 GEMM (no AVX512-BF16 / AMX), so torch's bf16 matmul costs about one matrix-vector product
per row; the int8 kernel is GEMV-shaped too, about 2x float32 GEMM per row; the
dequantization costs a few passes over the matrix, which many rows repay. The numerics stay the
decode kernels' (x rounded to bf16, products summed in float32, the sum rounded to bf16).
Measured on whole SmolLM2 decode steps of a batch (2 threads, fused projections, 2026-11-25),
step ms with the float32 path from N rows against the kernel: bf16 at 4 sequences 144 against
87, at 8 126 against 147, so 8 (it was 4, from single layers at 1 thread). That host had no
AVX512-BF16; on the later host, which has it, torch's bf16 matmul runs native bf16 dot products
and beat the float32 path at every row count (one SmolLM2 layer's four multiplies, alternated,
medians of 5: 0.27x-0.52x its time from 1 to 2,048 rows at 2 threads, 0.38x-0.60x at 1; a
cold 256-token bf16 prefill 0.22 s against 0.42 s, 1,024 tokens 1.37 against 1.92 s, whole
prefills alternated 4 times in one process), so bf16 keeps its kernel there
(`bf16_float32_rows`), as long as torch multiplies through oneDNN (without it, a bf16 matmul
took 22.7 ms where the float32 path took 4.5). int4 depends on the
kernels torch runs (`int4_float32_rows`). With its AVX-512 kernels (the host of later sessions)
the int4 kernel beat the float32 path at every row count measured, decode batches (4 sequences
49 against 246 ms a step, 16: 136 against 291) and prefill chunks alike (one SmolLM2 layer's
four multiplies: 0.40x the float32 path's time at 64 rows, 0.74x at 256, 0.94x at 2,048; 1
thread: 0.47x to 1.01x; a 256-token cold prefill 0.41 s against 0.51 s), so it keeps its
kernel, and a row's result then never depends on the rows beside it (docs/models.md). With
its AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2` on that host, and the table above on an AVX2 host)
the float32 path wins from about 96-256 rows (1 thread: 1.04x at 96 rows, 1.37x at 256), so
64 stays there."""


def _has_int8_dot_products() -> bool:
    """Whether `torch._int_mm` multiplies int8 matrices with the CPU's 8-bit integer dot
    products (AVX-512 VNNI: four products a lane where a float32 FMA does one)."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)  # private; absent: assume not
    avx512 = getattr(torch.cpu, "_is_avx512_supported", None)
    onednn = bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    if not hasattr(torch, "_int_mm") or probe is None or avx512 is None or not onednn:
        return False
    return bool(probe() and avx512())


INT8_DYNAMIC_HEAD = _has_int8_dot_products()
"""Whether an int8 output head on the CPU multiplies by `int8_dynamic_matmul` (activations
quantized per row, integer dot products) instead of `_weight_int8pack_mm`, and so whether the
quantized formats' head is int8 (worker/weight_formats.head_format). SmolLM2's head, 49,152 x
576, times one token at 2 threads on an AVX-512 VNNI host: 1.37 ms with its exact top, against
3.49 ms for the bf16 head (AVX512-BF16 dot products); `_int_mm` alone 1.5 / 1.8 / 4.2 ms at 1 /
4 / 32 rows against bf16's `F.linear` 4.2 / 3.6 / 7.6 (one probe), and with the activations'
quantization 57.8 ms at 256 rows against bf16's 54.5 and the float32 path's 113
(`benchmarks/linear_formats_bench.py`, weights cycled past the caches). It beats the float32
path, an int8 weight's only other way, at every row count measured, so it keeps its kernel at
every row count. Not for the projections: the int4 kernel reads half the bytes and
their few outputs do not repay quantizing the activations (qkv 27 against 49-64 us, down 39-53
against 60)."""


def int8_dynamic_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, fbgemm: object | None = None
) -> torch.Tensor:
    """x [rows, in] @ (q * scales[:, None]).T in float32, for q [out, in] int8 and per-row
    `scales` [out]: each row of x is quantized to int8 symmetrically by its own largest
    magnitude (x ~ xq * s, s = max|x| / 127, rounded half to even), the int8 products are
    summed exactly in int32 (`torch._int_mm`, or fbgemm's GEMM over `fbgemm`, q prepacked by
    worker/fbgemm_int8.py: the same sums, faster; not for rows with a NaN or an infinity, which
    fbgemm's own range of the whole batch cannot take), and the sums are scaled in float32.
    llama.cpp multiplies its quantized matrices the same way (its activations in blocks of 32).
    The sums are exact, so a row's result never depends on the rows beside it."""
    x32 = x.float()
    step = x32.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    levels = torch.round(x32 / step)
    if fbgemm is not None and bool(step.isfinite().all()):  # a NaN / inf row: _int_mm's NaNs
        return fbgemm_int8.scaled_sums(levels, fbgemm).mul_(step)
    weight = q.t() if q.shape[1] > 1 else q.t().contiguous()  # _int_mm misreads strides (1, 1)
    sums = torch._int_mm(levels.to(torch.int8), weight)
    return sums.float().mul_(scales).mul_(step)  # bf16 scales widen exactly


def head_float32_rows(fmt: LinearFormat) -> int:
    """The output head's FLOAT32_ROWS: its kernel at every row count where the format's kernel
    is the faster at every row count on this CPU (bf16 with AVX512-BF16, int4 with torch's
    AVX-512 kernels), else HEAD_FLOAT32_ROWS. On an AVX512-BF16 host, SmolLM2's bf16 head with
    its exact top (summed by `vecdot`) took 5.4 / 13.9 / 25.4 / 31.1 / 66.6 / 144 ms at 8 / 32 /
    64 / 128 / 256 / 512 rows against the float32 path's 45 / 53 / 62 / 83 / 131 / 217 (2
    threads, medians of 5); an int4 head (exact top by einsum then) 4.9 to 147 ms against 82 to
    163 up to 256 rows. Where the kernel is taken at every count, a row's logits no longer
    depend on how many rows share the call."""
    rows = FLOAT32_ROWS[fmt]
    return KERNEL_ONLY if rows == KERNEL_ONLY else HEAD_FLOAT32_ROWS


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
        triton: bool | None = None,
    ) -> None:
        """Pack `weight` ([out, in] float, or an already quantized one) as `fmt` for the device
        it is on. A float weight is quantized round-to-nearest (int4 in groups of `group_size`);
        a QuantizedWeight is packed as it is for int4 (it must be int4), quantized again per
        channel for int8, dequantized for bf16. `triton` (default: the weight is on CUDA)
        packs for the Triton kernel; forced on CPU tensors it runs under TRITON_INTERPRET=1
        (the tests)."""
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
        self.triton = device.type == "cuda" if triton is None else triton
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        self.float32_rows = FLOAT32_ROWS[fmt]
        self.is_head = False
        self.exact_top = 0
        """Logits recomputed exactly after the kernel (`as_head`); 0: none."""
        self.dynamic_int8 = False
        """An int8 head on the CPU: `int8_dynamic_matmul` (INT8_DYNAMIC_HEAD, `as_head`)."""
        self.fbgemm: object | None = None
        """Its int8 weight prepacked for fbgemm (worker/fbgemm_int8.py), made by `as_head`: a
        copy, so the head's `q` is not to be written in place after it (nothing does)."""
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
        elif not self.triton:
            pad = -self.out_features % INT4_CPU_ROWS  # the kernel takes whole blocks of rows
            q = nn.functional.pad(qw.q, (0, 0, 0, pad), value=OFFSET["int4"])
            scales, zeros = (nn.functional.pad(t, (0, 0, 0, pad)) for t in (scales, zeros))
            self.register_buffer("packed", pack_int4_cpu(q))
            self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], -1))
            int4pack_layout(self.in_features)  # found now (~0.3 s per width), not in a prefill
        else:
            self.register_buffer("packed", pack_nibbles(qw.q))
            self.register_buffer("scales", scales.contiguous())
            self.register_buffer("zeros", zeros.contiguous())

    @classmethod
    def concat(cls, parts: Sequence[QuantizedLinear]) -> QuantizedLinear:
        """One layer whose rows are `parts`' rows in order (each part's padded rows for the CPU
        int4 layout, so every part starts on a whole block), for parts of one format, group
        size, input width and device. Its buffers are new; each part's buffers become views
        of them (a part's CPU int4 scales a strided view), so memory is not doubled and a part
        called alone still multiplies by its own rows. Biases: all or none."""
        first = parts[0]
        kinds = {p.kind for p in parts}
        if len(parts) < 2 or len(kinds) != 1:
            raise ValueError(
                "concat takes two or more layers of one kind (format, group, inputs, device, "
                f"triton, bias or none), got {sorted(kinds, key=str)}"
            )
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.format, fused.group_size = first.format, first.group_size
        fused.in_features = first.in_features
        fused.device_type, fused.triton = first.device_type, first.triton
        fused.float32_rows, fused.is_head, fused.exact_top = first.float32_rows, False, 0
        fused.dynamic_int8, fused.fbgemm = False, None
        names = [name for name, _ in first.named_buffers()]
        dims = {name: 1 if name == "scales_and_zeros" else 0 for name in names}
        for name in names:
            fused.register_buffer(name, torch.cat([getattr(p, name) for p in parts], dims[name]))
        fused.out_features = int(fused.rows)
        fused.bias = None
        biases = [p.bias for p in parts if p.bias is not None]
        if biases:
            padded = [
                nn.functional.pad(b, (0, p.rows - p.out_features))
                for b, p in zip(biases, parts, strict=True)
            ]
            fused.bias = nn.Parameter(torch.cat(padded), False)
        row = 0
        for part in parts:
            for name in names:
                setattr(part, name, getattr(fused, name).narrow(dims[name], row, part.rows))
            if part.bias is not None and fused.bias is not None:
                part.bias = nn.Parameter(fused.bias[row : row + part.out_features], False)
            row += part.rows
        return fused

    def as_head(self) -> QuantizedLinear:
        """This layer as the output head, which gives logits, not activations (on the CPU: the
        GPU path is unchanged): the kernel with its HEAD_EXACT_TOP largest logits recomputed
        exactly, and from `head_float32_rows` rows (never, where the format's kernel is the
        faster at every row count) the float32 path, without rounding its output to bf16."""
        self.dynamic_int8 = self.format == "int8" and not self.triton and INT8_DYNAMIC_HEAD
        self.float32_rows = KERNEL_ONLY if self.dynamic_int8 else head_float32_rows(self.format)
        self.is_head, self.exact_top = True, HEAD_EXACT_TOP
        if self.dynamic_int8:
            self.fbgemm = fbgemm_int8.prepack(self.q, self.scales)
        return self

    @property
    def kind(self) -> tuple[object, ...]:
        """What layers must share to be concatenated: format, group size, input width, device,
        kernel, and whether they have a bias."""
        return (
            self.format,
            self.group_size,
            self.in_features,
            self.device_type,
            self.triton,
            self.bias is None,
        )

    @property
    def rows(self) -> int:
        """Rows of the weight as held: out_features, padded to a whole block for CPU int4."""
        if self.format == "bf16":
            return int(self.weight.shape[0])
        return int(self.q.shape[0] if self.format == "int8" else self.packed.shape[0])

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
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self._matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if not self.is_head:  # logits keep what the head computed them in (float32 on a CPU)
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def bound_matmul(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`_matmul` with what a CPU int4 projection's kernel call reads looked up once
        (worker/decode_layers.py calls it 120 times a step, where each lookup of a buffer and
        each branch costs a few microseconds); any other layer's own `_matmul`. It reads the
        buffers themselves, so weights loaded into them in place are seen, except a part's
        strided scales (`concat`), which it copies."""
        if self.triton or self.format != "int4" or self.dynamic_int8 or self.exact_top:
            return self._matmul
        packed, group, out = self.packed, self.group_size, self.out_features
        scales_and_zeros = self.scales_and_zeros.contiguous()  # a part's is a strided view
        rows, padded, fallback = self.float32_rows, self.rows != out, self._matmul
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu

        def matmul(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] >= rows:
                return fallback(x)
            y: torch.Tensor = kernel(x.to(torch.bfloat16), packed, group, scales_and_zeros)
            return y[:, :out] if padded else y

        return matmul

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ W.T in bf16 (the kernels' output; float32 from `int8_dynamic_matmul`
        and the float32 path), or x's dtype on the GPU."""
        if not self.triton:
            if x.shape[0] >= self.float32_rows:
                return self.float32_matmul(x)
            if self.exact_top:
                return self.exact_top_logits(x, self.kernel_matmul(x))
            return self.kernel_matmul(x)
        if self.format == "bf16":
            return F.linear(x.to(torch.bfloat16), self.weight)
        from kernels.quant_matmul import quant_matmul  # noqa: PLC0415 - triton only on GPU

        if self.format == "int8":
            q, scales, zeros, group = self.q, self.scales[:, None], None, self.in_features
        else:
            q, scales, zeros, group = self.packed, self.scales, self.zeros, self.group_size
        forced = None if x.is_cuda else "triton"  # CPU tensors: the interpreter (tests)
        return quant_matmul(x, q, scales, zeros, self.format, group, backend=forced)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU decode path: the format's own kernel, reading the packed weight (an int8
        head's in float32: `int8_dynamic_matmul`)."""
        if self.dynamic_int8:
            return int8_dynamic_matmul(x, self.q, self.scales, self.fbgemm)
        x16 = x.to(torch.bfloat16)
        if self.format == "bf16":
            return F.linear(x16, self.weight)
        if self.format == "int8":
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x16, self.q, self.scales)
            return y
        scales_and_zeros = self.scales_and_zeros  # a strided view once concat made this a part
        if not scales_and_zeros.is_contiguous():
            scales_and_zeros = scales_and_zeros.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x16, self.packed, self.group_size, scales_and_zeros
        )
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]

    def exact_top_logits(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the kernel's logits of x, bf16 or float32) in float32, its `exact_top` largest
        per row replaced by x (float32) times their weight rows, summed in float32 by `vecdot`, a
        product and a sum along each row: a row's sums then never depend on the rows beside it
        (`einsum`'s batched product summed a row alone in another order than in a batch)."""
        top = y.topk(min(self.exact_top, self.out_features), dim=-1).indices
        logits, x32 = y.float(), x.float()
        for start in range(0, x.shape[0], EXACT_ROWS_PER_PASS):
            part = slice(start, start + EXACT_ROWS_PER_PASS)
            rows = self._weight_rows(top[part])
            logits[part].scatter_(1, top[part], torch.linalg.vecdot(rows, x32[part, None, :]))
        return logits

    def _weight_rows(self, top: torch.Tensor) -> torch.Tensor:
        """The weight rows `top` ([m, k] row ids), dequantized to float32 ([m, k, in])."""
        if self.format == "bf16":
            return self.weight[top].float()
        if self.format == "int8":
            return self.q[top].float() * self.scales[top].float()[..., None]
        return self._int4_rows(top)

    def _int4_rows(self, top: torch.Tensor) -> torch.Tensor:
        """The weight rows `top` ([m, k] row ids) of a CPU int4 layer, dequantized to float32
        ([m, k, in]) as `reference_weight` dequantizes them."""
        levels = int4pack_rows(self.packed, self.in_features, top)
        per_group = self.scales_and_zeros[:, top]  # [in / g, m, k, 2]
        scales, zeros = per_group[..., 0].movedim(0, -1), per_group[..., 1].movedim(0, -1)
        return int4_values(levels, scales, zeros, self.group_size, torch.float32)

    def float32_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU prefill path: the same sums (bf16 x bf16 products are exact in float32),
        from the weight dequantized to float32, by float32 GEMM; rounded to bf16 as the
        kernels round. The roundings are what keeps a prompt's logits the same cached and cold
        (tests/worker/test_weight_formats.py): without them a 1,999-token int4 prefill of
        SmolLM2 ran about 4 % faster, and greedy tokens of the tiny bf16 model changed between
        a cold prefill and a cached one."""
        if self.is_head:  # logits: x as it is, the sums as they are (`as_head`)
            return F.linear(x.float(), self.reference_weight(torch.float32))
        x32 = x.to(torch.bfloat16).float()
        return F.linear(x32, self.reference_weight(torch.float32)).to(torch.bfloat16)

    def reference_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] matrix this layer multiplies by, dequantized in `dtype` (the reference
        every path is tested against; the CPU prefill path multiplies by it)."""
        if self.format == "bf16":
            return self.weight.to(dtype)
        if self.format == "int8":
            return self.q.to(dtype) * self.scales[:, None].to(dtype)
        out, inp, g = self.out_features, self.in_features, self.group_size
        if not self.triton:  # levels [rows, in], scales and zeros [rows, in / g]
            q = int4pack_levels(self.packed, inp)
            scales = self.scales_and_zeros[..., 0].t()
            zeros = self.scales_and_zeros[..., 1].t()
        else:
            q, scales, zeros = unpack_nibbles(self.packed), self.scales, self.zeros
        return int4_values(q, scales, zeros, g, dtype)[:out]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (values + scales + zeros + bias)."""
        return sum(t.nbytes for t in self.buffers()) + sum(p.nbytes for p in self.parameters())

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}{group}, "
            f"device={self.device_type}, triton={self.triton}"
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


@cache
def int4pack_layout(inp: int) -> int | torch.Tensor:
    """How torch's CPU int4pack lays out a block of INT4_CPU_ROWS rows x `inp` columns, found by
    packing the flat indices themselves, four bits at a time, and reading where they landed:

    - an int r when the block is the layout torch's AVX-512 (r = 64) and AVX2 (r = 32) code
      writes: per r rows, for each column k, r/2 bytes whose byte j holds row j in its low
      nibble and row j + r/2 in its high one (read back by one permute);
    - else the gather order: level [row, column] is nibble order[row * inp + column] of the
      block (nibbles counted byte by byte, low first), whatever the build did."""
    landed = int4pack_probe(inp)
    index = torch.arange(landed.numel(), dtype=torch.int64)
    for rows in (64, 32):
        blocked = index.view(INT4_CPU_ROWS // rows, 2, rows // 2, inp)
        if torch.equal(landed, blocked.permute(0, 3, 2, 1).reshape(-1)):
            return rows
    return torch.argsort(landed)


def int4pack_probe(inp: int) -> torch.Tensor:
    """For each nibble of a packed block of INT4_CPU_ROWS x `inp` levels (byte by byte, low
    nibble first), the flat index row * inp + column of the level that landed there."""
    size = INT4_CPU_ROWS * inp
    index = torch.arange(size, dtype=torch.int64)
    landed = torch.zeros(size, dtype=torch.int64)
    for shift in range(0, max(size - 1, 1).bit_length(), 4):
        digits = ((index >> shift) & 15).reshape(INT4_CPU_ROWS, inp)
        landed |= _nibbles(pack_int4_cpu(digits)).reshape(-1).long() << shift
    return landed


def int4pack_levels(
    packed: torch.Tensor, inp: int, layout: int | torch.Tensor | None = None
) -> torch.Tensor:
    """The levels 0..15 [rows, in] (uint8) a CPU int4pack tensor holds (rows: a multiple of
    INT4_CPU_ROWS, as QuantizedLinear pads them); `layout` as int4pack_layout returns it
    (default: this build's)."""
    rows = packed.shape[0]
    layout = int4pack_layout(inp) if layout is None else layout
    nibbles = _nibbles(packed)
    if isinstance(layout, int):
        blocks = nibbles.view(rows // layout, inp, layout // 2, 2)
        return blocks.permute(0, 3, 2, 1).reshape(rows, inp)
    blocks = nibbles.reshape(rows // INT4_CPU_ROWS, INT4_CPU_ROWS * inp)
    return blocks.index_select(1, layout).reshape(rows, inp)


def int4_values(
    levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """int4 weights [..., in] in `dtype` from their levels 0..15 [..., in] and their groups'
    scales and zeros [..., in / group]: (level - 8) * scale + zero."""
    *lead, inp = levels.shape
    w = levels.reshape(*lead, inp // group, group).to(dtype).sub_(OFFSET["int4"])
    w = w.mul_(scales[..., None].to(dtype)).add_(zeros[..., None].to(dtype))
    return w.reshape(*lead, inp)


def int4pack_rows(
    packed: torch.Tensor, inp: int, rows: torch.Tensor, layout: int | torch.Tensor | None = None
) -> torch.Tensor:
    """The levels 0..15 [*rows.shape, in] (uint8) of the given rows of a CPU int4pack tensor,
    read without unpacking the others (what `int4pack_levels(...)[rows]` gives)."""
    layout = int4pack_layout(inp) if layout is None else layout
    if isinstance(layout, int):  # per block of `layout` rows, byte [k, j]: rows j and j + half
        half = layout // 2
        within = rows % layout
        found = packed.view(-1, inp, half)[rows // layout, :, within % half]
        high = (within >= half)[..., None]
    else:  # nibble order[r * inp + k] of the row's block holds its level k
        nibble = layout.view(INT4_CPU_ROWS, inp)[rows % INT4_CPU_ROWS]
        blocks = packed.view(-1, INT4_CPU_ROWS * inp // 2)
        found = blocks[(rows // INT4_CPU_ROWS)[..., None], nibble // 2]
        high = nibble % 2 == 1
    return torch.where(high, found >> 4, found & 15)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., n, 2]: low nibble, high nibble."""
    return torch.stack([packed & 15, packed >> 4], -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] uint8 0..15 -> [out, in/2] uint8: column 2j in the low nibble, 2j+1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    return _nibbles(packed).reshape(out, 2 * half)
