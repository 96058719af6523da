"""QuantizedLinear: each format multiplies by exactly the matrix it says it holds
(`reference_weight`), that matrix is the quantization the format promises of the float weight,
the packed buffers hold the levels given to them, the layer is a drop-in for nn.Linear (bias,
leading dimensions, x's dtype out), it holds the bytes the format promises, and bad inputs are
refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.worker.helpers import relative_error
from worker.quantized_linear import (
    FLOAT32_ROWS,
    INT4_CPU_ROWS,
    KERNEL_ONLY,
    LINEAR_FORMATS,
    QuantizedLinear,
    bf16_float32_rows,
    int4_float32_rows,
    int4pack_layout,
    int4pack_levels,
    int4pack_probe,
    int4pack_rows,
    pack_int4_cpu,
)
from worker.quantized_weights import OFFSET, QuantizedWeight, quantize

BF16_EPS = 2.0**-8
"""bf16 keeps 8 significant bits: rounding moves a value by at most this, relatively."""
SHAPES = [(48, 96), (32, 64), (72, 128)]
"""32 rows: a tiny k_proj; 72: not a multiple of the CPU int4 kernel's 16 rows (padded)."""


def int4pack_oracle(packed: torch.Tensor, inp: int) -> torch.Tensor:
    """The levels of a CPU int4pack tensor, read by torch's own kernel: multiplying the identity
    with scale 1 and zero 8 gives level - 8 + 8 for each weight, exactly (layout-blind)."""
    rows = packed.shape[0]
    eye = torch.eye(inp, dtype=torch.bfloat16)
    ones = torch.ones(inp // 32, rows)
    scales_and_zeros = torch.stack([ones, 8 * ones], -1).to(torch.bfloat16)
    levels = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, scales_and_zeros)
    return levels.t().round().to(torch.uint8)


def weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) / inp**0.5


def activations(rows: int, inp: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", LINEAR_FORMATS)
@pytest.mark.parametrize(("out", "inp"), SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 40, 70])
def test_each_format_multiplies_by_its_reference_weight(
    fmt: str, out: int, inp: int, rows: int
) -> None:
    """Against x (rounded to bf16, as the layer feeds the kernels) @ reference_weight in float64:
    the only other error allowed is the product's rounding to bf16."""
    layer = QuantizedLinear(weight(out, inp), fmt)  # type: ignore[arg-type]
    x = activations(rows, inp)
    y = layer(x)
    oracle = x.to(torch.bfloat16).double() @ layer.reference_weight().double().t()
    assert y.dtype == torch.float32 and y.shape == (rows, out)
    assert relative_error(y.double(), oracle) < BF16_EPS


@pytest.mark.parametrize("inp", [64, 576, 1536])
def test_the_int4pack_layout_found_by_probing_is_the_kernels(inp: int) -> None:
    """int4pack_levels (a gather by the probed order) reads what torch's kernel reads."""
    gen = torch.Generator().manual_seed(inp)
    q = torch.randint(0, 16, (2 * INT4_CPU_ROWS, inp), generator=gen, dtype=torch.uint8)
    packed = pack_int4_cpu(q)
    assert torch.equal(int4pack_oracle(packed, inp), q)
    assert torch.equal(int4pack_levels(packed, inp), q)
    expected = {"AVX2": 32, "AVX512": 64}.get(torch.backends.cpu.get_cpu_capability())
    if expected is not None:  # torch's vectorised builds: the one-permute layouts
        assert int4pack_layout(inp) == expected
    gather = torch.argsort(int4pack_probe(inp))  # the path a build of another layout takes
    assert torch.equal(int4pack_levels(packed, inp, gather), q)
    rows = torch.randint(0, 2 * INT4_CPU_ROWS, (3, 9), generator=gen)
    for layout in (None, gather):  # a few rows read alone (the head's exact leaders)
        assert torch.equal(int4pack_rows(packed, inp, rows, layout), q[rows])
    noise = torch.randint(0, 256, packed.shape, generator=gen, dtype=torch.uint8)
    for layout in (32, 64, gather):  # both one-permute layouts, whichever this build writes
        levels = int4pack_levels(noise, inp, layout)
        assert torch.equal(int4pack_rows(noise, inp, rows, layout), levels[rows])


def test_the_float32_path_is_kept_only_where_it_is_the_faster() -> None:
    assert int4_float32_rows("AVX512") == KERNEL_ONLY
    assert int4_float32_rows("AVX2") == int4_float32_rows("DEFAULT") == 64
    assert bf16_float32_rows(True) == KERNEL_ONLY and bf16_float32_rows(False) == 8


@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_bf16_holds_the_weight_rounded_to_bf16(out: int, inp: int) -> None:
    w = weight(out, inp)
    layer = QuantizedLinear(w, "bf16")
    assert torch.equal(layer.reference_weight(), w.to(torch.bfloat16).float())


@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_int8_is_symmetric_per_channel_within_half_a_step(out: int, inp: int) -> None:
    """|W - W'| <= half a step (row max / 127) plus the bf16 rounding of the scale."""
    w = weight(out, inp)
    layer = QuantizedLinear(w, "int8")
    row_max = w.abs().amax(1, keepdim=True)
    step = row_max / 127
    bound = step / 2 + row_max * BF16_EPS + 1e-7
    assert bool(((layer.reference_weight() - w).abs() <= bound).all())
    assert layer.q.dtype == torch.int8 and layer.scales.shape == (out,)
    assert int(layer.q.abs().amax(1).min()) >= 126, "each row's largest weight uses the range"


@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_int4_holds_the_levels_of_round_to_nearest_groups(out: int, inp: int) -> None:
    """The CPU int4pack buffer unpacks to quantize()'s levels, and the layer's matrix is
    worker/quantized_weights.py's formula with bf16 scales and zeros: within half a group's step
    (plus that rounding) of the float weight."""
    w = weight(out, inp)
    layer = QuantizedLinear(w, "int4")
    qw = quantize(w, "int4")
    assert torch.equal(int4pack_levels(layer.packed, inp)[:out], qw.q)
    s, z = qw.scales.to(torch.bfloat16).float(), qw.zeros.to(torch.bfloat16).float()
    g = qw.group_size
    expected = (qw.q.float().reshape(out, -1, g) - OFFSET["int4"]) * s[..., None] + z[..., None]
    assert torch.equal(layer.reference_weight(), expected.reshape(out, inp))
    step = qw.scales.repeat_interleave(g, 1)
    rounding = (8 * step + qw.zeros.abs().repeat_interleave(g, 1)) * BF16_EPS
    assert bool(((layer.reference_weight() - w).abs() <= step / 2 + rounding + 1e-7).all())


def test_a_given_int4_weight_is_packed_as_it_is() -> None:
    """A QuantizedWeight (e.g. GGUF blocks) keeps its levels, scales, zeros and group."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (40, 128), generator=gen, dtype=torch.uint8)
    scales, zeros = torch.rand(40, 2, generator=gen), torch.randn(40, 2, generator=gen)
    qw = QuantizedWeight("int4", q, scales, zeros, 64)
    layer = QuantizedLinear(qw, "int4")
    assert layer.group_size == 64
    assert torch.equal(int4pack_levels(layer.packed, 128)[:40], q)
    x = activations(3, 128)
    oracle = x.to(torch.bfloat16).double() @ layer.reference_weight().double().t()
    assert relative_error(layer(x).double(), oracle) < BF16_EPS


def test_a_grouped_int8_weight_is_requantized_per_channel() -> None:
    w = weight(24, 96)
    grouped = quantize(w, "int8")  # GGUF Q8_0's form: groups of 32
    layer = QuantizedLinear(grouped, "int8")
    assert layer.scales.shape == (24,) and layer.group_size == 96
    assert relative_error(layer.reference_weight(), w) < 0.01


def test_a_drop_in_for_nn_linear() -> None:
    """Bias, leading dimensions, and x's dtype out, as nn.Linear."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    for fmt in LINEAR_FORMATS:
        layer = QuantizedLinear.from_linear(linear, fmt)
        assert (layer.in_features, layer.out_features) == (64, 48)
        x = torch.randn(2, 3, 64)
        y = layer(x)
        assert y.shape == (2, 3, 48) and y.dtype == torch.float32
        flat = layer(x.reshape(6, 64)).reshape(2, 3, 48)
        assert torch.equal(y, flat)
        no_bias = y - linear.bias.detach()
        oracle = x.to(torch.bfloat16).double() @ layer.reference_weight().double().t()
        assert relative_error(no_bias.double(), oracle) < BF16_EPS
        assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
        assert relative_error(y, linear(x).detach()) < {"bf16": 0.01, "int8": 0.02}.get(fmt, 0.2)


def test_each_format_holds_the_bytes_it_promises() -> None:
    out, inp = 128, 256
    w = weight(out, inp)
    sizes = {fmt: QuantizedLinear(w, fmt).nbytes for fmt in LINEAR_FORMATS}  # whole blocks
    assert sizes["bf16"] == out * inp * 2
    assert sizes["int8"] == out * inp + out * 2  # values + a bf16 scale per row
    assert sizes["int4"] == out * inp // 2 + out * (inp // 32) * 2 * 2  # + bf16 scale and zero
    padded = QuantizedLinear(weight(70, inp), "int4").nbytes  # 70 rows held as 128
    assert padded == 128 * inp // 2 + 128 * (inp // 32) * 2 * 2


def test_bad_inputs_are_refused_by_name() -> None:
    w = weight(8, 64)
    with pytest.raises(ValueError, match=r"format must be one of .*'int3'"):
        QuantizedLinear(w, "int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"weight must be \[out, in\]"):
        QuantizedLinear(w[None], "int4")
    with pytest.raises(ValueError, match="a int8 QuantizedWeight cannot be packed as int4"):
        QuantizedLinear(quantize(w, "int8"), "int4")
    with pytest.raises(ValueError, match="do not split into groups of 32"):
        QuantizedLinear(weight(8, 48), "int4")


def test_a_layer_called_on_another_device_says_to_pack_it_there() -> None:
    layer = QuantizedLinear(weight(8, 64), "int4")
    with pytest.raises(RuntimeError, match="packed for cpu, called on meta"):
        layer(torch.empty(1, 64, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", LINEAR_FORMATS)
def test_cuda_layers_multiply_by_the_same_matrix_as_cpu_layers(fmt: str) -> None:
    """int4 is quantized once and both layers pack that: quantized on the GPU, some float32
    scales round one ulp away from the CPU's (seen on an H100), which bf16 rounding can carry
    into the matrix. 7 rows take the tile kernel, 1 row the row kernel."""
    w = weight(1536, 576)
    source: torch.Tensor | QuantizedWeight = w
    on_cuda: torch.Tensor | QuantizedWeight = w.cuda()
    if fmt == "int4":
        source = quantize(w, "int4", 32)
        on_cuda = source.to("cuda")
    cpu = QuantizedLinear(source, fmt)  # type: ignore[arg-type]
    cuda = QuantizedLinear(on_cuda, fmt)  # type: ignore[arg-type]
    assert torch.equal(cuda.reference_weight().cpu(), cpu.reference_weight())
    for rows in (7, 1):
        x = activations(rows, 576).to(torch.bfloat16)
        oracle = x.double() @ cpu.reference_weight().double().t()
        assert relative_error(cuda(x.cuda()).cpu().double(), oracle) < BF16_EPS


@pytest.mark.parametrize("fmt", LINEAR_FORMATS)
def test_rows_agree_whichever_cpu_path_they_take(fmt: str) -> None:
    """A decode row (the format's kernel) and the same row inside a prefill chunk (float32 GEMM
    on the dequantized weight, past FLOAT32_ROWS) compute the same sums: equal up to one bf16
    rounding step of the result. int4, where its kernel takes every row count, gives a row the
    same bits alone and in a chunk (bf16's oneDNN kernel does not promise that: a one-row call
    over 1,152 inputs or more sums in another order)."""
    layer = QuantizedLinear(weight(96, 128), fmt)  # type: ignore[arg-type]
    kernel_only = FLOAT32_ROWS[fmt] == KERNEL_ONLY
    x = activations((300 if kernel_only else FLOAT32_ROWS[fmt]) + 4, 128)
    chunk = layer(x)
    path = layer.kernel_matmul if kernel_only else layer.float32_matmul
    assert torch.equal(chunk, path(x).float())
    for row in range(3):
        alone = layer(x[row : row + 1])
        assert torch.equal(alone, layer.kernel_matmul(x[row : row + 1]).float())
        assert bool(((alone - chunk[row]).abs() <= chunk[row].abs() * BF16_EPS + 1e-6).all())
        if kernel_only and fmt == "int4":
            assert torch.equal(alone[0], chunk[row])


@pytest.mark.parametrize("fmt", LINEAR_FORMATS)
def test_bound_matmul_is_matmul(fmt: str) -> None:
    """`bound_matmul` gives `_matmul`'s bits at every row count, for a padded layer (72 rows)
    and for a part of a concatenated layer (its scales a strided view); formats other than
    CPU int4 get `_matmul` itself."""
    layers = [QuantizedLinear(weight(72, 128, seed), fmt) for seed in (1, 2)]  # type: ignore[arg-type]
    fused = QuantizedLinear.concat(layers)
    for layer in (*layers, fused):
        bound = layer.bound_matmul()
        if fmt != "int4":
            assert bound == layer._matmul
        for rows in (1, 5, 70):
            x = activations(rows, 128, seed=rows)
            assert torch.equal(bound(x), layer._matmul(x)), (fmt, rows)


def test_a_quantized_weight_moves_as_it_is() -> None:
    """`QuantizedWeight.to`: the same values on the device asked for, itself where it is."""
    qw = quantize(weight(64, 64), "int4", 32)
    assert qw.to("cpu") is qw and qw.to(torch.device("cpu")) is qw
    moved = qw.to("meta")
    assert moved is not qw and moved.q.device.type == "meta" and moved.zeros.device.type == "meta"
    assert (moved.format, moved.group_size, moved.shape) == (qw.format, qw.group_size, qw.shape)
