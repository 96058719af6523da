"""Weight-only quantized matmul: the Triton kernel (interpreted here) against the reference and a
float64 dense product, the reference against an independent dequantization, every bad argument
refused by name, and the dispatch (CPU tensors never reach Triton unless forced)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels.errors import KernelInputError
from kernels.quant_matmul import (
    choose_quant_matmul_backend,
    dequantize_reference,
    quant_matmul,
    quant_matmul_reference,
)
from tests.kernels.helpers import assert_close, fresh_seed, generator

CPU = torch.device("cpu")
X_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_weight(
    seed: int, fmt: str, out: int, inp: int, group: int, with_zeros: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(values, scales, zeros, q) with random levels and bf16 scales / zeros (the layout
    worker/quantized_linear.py stores); q is the unpacked [out, in] levels."""
    gen = generator(seed)
    if fmt == "int4":
        q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
        values = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    else:
        q = torch.randint(-128, 128, (out, inp), generator=gen, dtype=torch.int8)
        values = q
    scales = (torch.rand(out, inp // group, generator=gen) * 0.1 + 0.01).to(torch.bfloat16)
    zeros = None
    if with_zeros:
        zeros = (torch.randn(out, inp // group, generator=gen) * 0.1).to(torch.bfloat16)
    return values, scales, zeros, q


Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def on(device: torch.device, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
       zeros: torch.Tensor | None) -> Operands:  # fmt: skip
    """(x, values, scales, zeros) moved to `device`."""
    return (
        x.to(device), values.to(device), scales.to(device),
        None if zeros is None else zeros.to(device),
    )  # fmt: skip


def dense(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, fmt: str, group: int
) -> torch.Tensor:
    """W in float64, element by element from the levels: an independent dequantization."""
    offset = 8 if fmt == "int4" else 0
    idx = torch.arange(q.shape[1]) // group
    w = (q.double() - offset) * scales.double()[:, idx]
    return w + zeros.double()[:, idx] if zeros is not None else w


@pytest.mark.parametrize(("fmt", "group", "zeros"), [("int4", 32, True), ("int8", 32, False)])
def test_the_reference_dequantizes_as_the_layout_says(fmt: str, group: int, zeros: bool) -> None:
    seed = fresh_seed()
    values, scales, z, q = make_weight(seed, fmt, 24, 96, group, zeros)
    got = dequantize_reference(values, scales, z, fmt, group)
    assert torch.equal(got.double(), dense(q, scales, z, fmt, group)), f"seed {seed}"


@pytest.mark.parametrize("rows", [3, 1], ids=["tiles", "one-row"])
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("fmt", "group", "zeros"),
    [("int4", 32, True), ("int4", 64, False), ("int8", 32, True), ("int8", 128, False)],
)
def test_triton_matches_the_reference(
    triton_device: torch.device, dtype: torch.dtype, fmt: str, group: int, zeros: bool, rows: int
) -> None:
    """72 outputs (a partial column block), 128 inputs (two K tiles), 3 rows (a partial row
    block), or one row (the row kernel: a partial K tile of groups); int8 with G = K is the
    per-channel form QuantizedLinear uses."""
    seed = fresh_seed()
    values, scales, z, q = make_weight(seed, fmt, 72, 128, group, zeros)
    x = torch.randn(rows, 128, generator=generator(seed + 1)).to(dtype)
    y = quant_matmul(*on(triton_device, x, values, scales, z), fmt, group, backend="triton")
    assert y.dtype == dtype and y.shape == (rows, 72)
    oracle = (x.double() @ dense(q, scales, z, fmt, group).t()).to(dtype)
    assert_close(y.cpu(), oracle, seed, "quant_matmul", f"{fmt} g{group}")
    reference = quant_matmul_reference(x, values, scales, z, fmt, group)
    assert_close(reference, oracle, seed, "quant_matmul_reference", f"{fmt} g{group}")


@pytest.mark.parametrize(
    ("fmt", "inp", "group", "block_k", "split"),
    [
        ("int4", 320, 32, 64, 3),  # 5 tiles over 3 programs: the last has one tile past K
        ("int4", 256, 64, 128, 2),
        ("int8", 192, 192, 256, 1),  # per channel, K not a multiple of the tile
        ("int8", 384, 192, 64, 3),  # tiles inside groups of 192
    ],
)
def test_the_row_kernel_splits_k_and_keeps_groups_whole(
    triton_device: torch.device, fmt: str, inp: int, group: int, block_k: int, split: int
) -> None:
    """One row of a strided x (every other column of a wider tensor) by `quant_gemv` with K cut
    into `split` parts whose partial sums add up; `gemv_block_k` never gives a tile that
    straddles groups."""
    from kernels.triton_quant_matmul import GEMV_BLOCK_N, gemv_block_k, gemv_split, quant_gemv

    seed = fresh_seed()
    values, scales, z, q = make_weight(seed, fmt, 40, inp, group, fmt == "int4")
    wide = torch.randn(1, 2 * inp, generator=generator(seed + 1))
    x = wide[:, ::2]
    assert x.stride(1) == 2
    programs = split * -(-40 // GEMV_BLOCK_N)
    assert -(-inp // gemv_split(inp, 40, block_k, programs)) == split
    operands = on(triton_device, x, values, scales, z)
    y = quant_gemv(*operands, fmt, group, block_k, programs)
    oracle = (x.double() @ dense(q, scales, z, fmt, group).t()).float()
    assert_close(y.cpu(), oracle, seed, "quant_matmul", f"row kernel {fmt} split {split}")
    assert gemv_block_k(inp, group) is not None


def test_the_row_kernels_tile_keeps_groups_whole_or_declines() -> None:
    from kernels.triton_quant_matmul import gemv_block_k

    assert gemv_block_k(4096, 32) == 256  # eight whole groups a tile
    assert gemv_block_k(4096, 4096) == 256 and gemv_block_k(96, 96) == 256  # one group a row
    assert gemv_block_k(14336, 384) == 128  # tiles inside groups of 384
    assert gemv_block_k(96, 48) is None  # 48 neither divides a tile nor is divided by one
    assert gemv_block_k(64, 1) is None  # groups of 1 would split int4's bytes


@pytest.mark.parametrize(
    ("fmt", "inp", "group"),
    [
        ("int8", 96, 96),  # one group a row, fewer inputs than a tile, not a power of two
        ("int8", 48, 48),
        ("int4", 96, 96),
        ("int4", 40, 40),
        ("int8", 64, 1),  # groups of 1: the tile kernel for int4, whose bytes hold two groups
        ("int4", 64, 1),
        ("int8", 64, 64),
    ],
)
def test_one_row_of_any_valid_grouping_matches_the_reference(
    triton_device: torch.device, fmt: str, inp: int, group: int
) -> None:
    """Whatever `gemv_block_k` picks for one row (the row kernel or the tile kernel), the
    product is right; among them the one-group-a-row widths a tile of 256 does not divide."""
    seed = fresh_seed()
    values, scales, z, q = make_weight(seed, fmt, 24, inp, group, fmt == "int4")
    x = torch.randn(1, inp, generator=generator(seed + 1))
    y = quant_matmul(*on(triton_device, x, values, scales, z), fmt, group, backend="triton")
    oracle = (x.double() @ dense(q, scales, z, fmt, group).t()).float()
    assert_close(y.cpu(), oracle, seed, "quant_matmul", f"one row {fmt} {inp} g{group}")


def test_one_row_of_no_inputs_is_zeros(triton_device: torch.device) -> None:
    from kernels.triton_quant_matmul import quant_matmul as triton_quant_matmul

    values = torch.zeros(5, 0, dtype=torch.int8)
    scales = torch.ones(5, 0)
    x = torch.zeros(1, 0)
    y = triton_quant_matmul(*on(triton_device, x, values, scales, None), "int8", 64)
    assert y.shape == (1, 5) and not bool(y.any())


def test_triton_blocks_rows_and_takes_strided_x(triton_device: torch.device) -> None:
    """20 rows in blocks of 16 (two row blocks), x a column slice of a wider tensor."""
    from kernels.triton_quant_matmul import quant_matmul as triton_quant_matmul

    seed = fresh_seed()
    values, scales, z, q = make_weight(seed, "int4", 40, 64, 32)
    wide = torch.randn(20, 80, generator=generator(seed + 1))
    x = wide[:, 8:72]
    y = triton_quant_matmul(*on(triton_device, x, values, scales, z), "int4", 32, block_m=16)
    oracle = (x.double() @ dense(q, scales, z, "int4", 32).t()).float()
    assert_close(y.cpu(), oracle, seed, "quant_matmul", "block_m=16, strided x")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_a_quantized_linear_packed_for_triton_multiplies_like_the_cpu_one(
    triton_device: torch.device, fmt: str
) -> None:
    """worker/quantized_linear.py's GPU layout and wiring, interpreted here: the same matrix as
    the CPU layout holds, and the product through the Triton kernel (which takes x in its own
    dtype; bf16 is a bf16 matmul, x rounded to bf16). int4 is quantized once and both layers
    pack that: quantizing on a GPU rounds some float32 scales one ulp away from the CPU's (185
    of 288 on an H100), which bf16 rounding can carry into the matrix."""
    from worker.quantized_linear import QuantizedLinear
    from worker.quantized_weights import QuantizedWeight, quantize

    seed = fresh_seed()
    gen = generator(seed)
    w = torch.randn(72, 128, generator=gen) / 128**0.5
    bias = torch.randn(72, generator=gen)
    source: torch.Tensor | QuantizedWeight = w
    on_device: torch.Tensor | QuantizedWeight = w.to(triton_device)
    if fmt == "int4":
        source = quantize(w, "int4", 32)
        on_device = source.to(triton_device)
    cpu = QuantizedLinear(source, fmt, bias)  # type: ignore[arg-type]
    gpu = QuantizedLinear(on_device, fmt, bias.to(triton_device), triton=True)  # type: ignore[arg-type]
    assert gpu.triton and not cpu.triton
    assert torch.equal(gpu.reference_weight().cpu(), cpu.reference_weight())
    x = torch.randn(5, 128, generator=generator(seed + 1))
    y = gpu(x.to(triton_device))
    assert y.dtype == torch.float32
    rows = x.to(torch.bfloat16) if fmt == "bf16" else x
    oracle = rows.double() @ cpu.reference_weight().double().t() + bias.double()
    if fmt == "bf16":  # the product rounded to bf16 as well
        oracle = oracle.to(torch.bfloat16)
        y = y.to(torch.bfloat16)
    assert_close(y.cpu(), oracle.to(y.dtype), seed, "quant_matmul", f"QuantizedLinear {fmt}")


def test_an_empty_batch_gives_an_empty_result(triton_device: torch.device) -> None:
    values, scales, z, _ = make_weight(0, "int4", 8, 32, 32)
    x = torch.empty(0, 32)
    y = quant_matmul(*on(triton_device, x, values, scales, z), "int4", 32, backend="triton")
    assert y.shape == (0, 8)


def test_cpu_tensors_take_the_reference_unless_triton_is_forced() -> None:
    x = torch.randn(2, 64)
    assert choose_quant_matmul_backend(x) == "reference"
    assert choose_quant_matmul_backend(x, "reference") == "reference"
    with pytest.raises(KernelInputError, match="backend: 'cuda' is not one of"):
        choose_quant_matmul_backend(x, "cuda")


def test_the_cpu_path_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from kernels.quant_matmul import quant_matmul\n"
        "v = torch.zeros(4, 16, dtype=torch.uint8)\n"
        "quant_matmul(torch.randn(2, 32), v, torch.ones(4, 1), None, 'int4', 32)\n"
        "print('triton' in sys.modules)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "the CPU path imported triton"


def _args() -> dict[str, object]:
    values, scales, zeros, _ = make_weight(0, "int4", 8, 64, 32)
    return {
        "x": torch.randn(2, 64),
        "values": values,
        "scales": scales,
        "zeros": zeros,
        "fmt": "int4",
        "group_size": 32,
    }


BAD = [
    ("fmt", {"fmt": "int3"}, "is not one of"),
    ("x", {"x": torch.randn(2, 3, 64)}, "must be [rows, in]"),
    ("x", {"x": torch.randn(2, 64).double()}, "dtype torch.float64"),
    ("group_size", {"group_size": 48}, "does not divide"),
    ("group_size", {"group_size": 0}, "does not divide"),
    ("values", {"values": torch.zeros(8, 64, dtype=torch.uint8)}, "needs [out, 32]"),
    ("values", {"values": torch.zeros(8, 32, dtype=torch.int8)}, "torch.uint8"),
    ("values", {"fmt": "int8"}, "needs [out, 64] torch.int8"),
    ("scales", {"scales": torch.ones(8, 3)}, "must have shape [8, 2]"),
    ("scales", {"scales": torch.ones(8, 2, dtype=torch.int32)}, "floating point"),
    ("zeros", {"zeros": torch.ones(4, 2)}, "must have shape [8, 2]"),
    ("scales", {"scales": torch.ones(2, 8).t()}, "contiguous"),
]


@pytest.mark.parametrize(("argument", "change", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_refused_by_name(
    argument: str, change: dict[str, object], message: str
) -> None:
    args = {**_args(), **change}
    with pytest.raises(KernelInputError) as refused:
        quant_matmul(**args)  # type: ignore[arg-type]
    assert refused.value.argument == argument
    assert message in str(refused.value)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize(("out", "inp"), [(49152, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_cuda_matches_the_reference_at_smollm_shapes(
    rows: int, out: int, inp: int, fmt: str
) -> None:
    seed = fresh_seed()
    group = 32 if fmt == "int4" else inp
    values, scales, z, _ = make_weight(seed, fmt, out, inp, group, fmt == "int4")
    x = torch.randn(rows, inp, generator=generator(seed + 1)).to(torch.bfloat16)
    y = quant_matmul(*on(torch.device("cuda"), x, values, scales, z), fmt, group)
    reference = quant_matmul_reference(x, values, scales, z, fmt, group)
    assert_close(y.cpu(), reference, seed, "quant_matmul", f"{fmt} {out}x{inp} x{rows}")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_fused_triton_layers_give_each_part(triton_device: torch.device, fmt: str) -> None:
    """worker/fused_projections.py on the Triton layout: parts of 72, 40 and 40 rows fused into
    one layer give each part's outputs (each column is the same dot product)."""
    from worker.fused_projections import FusedProjections
    from worker.quantized_linear import QuantizedLinear

    seed = fresh_seed()
    gen = generator(seed)
    parts = [
        QuantizedLinear(torch.randn(out, 64, generator=gen).to(triton_device), fmt, triton=True)  # type: ignore[arg-type]
        for out in (72, 40, 40)
    ]
    x = torch.randn(3, 64, generator=generator(seed + 1)).to(triton_device)
    alone = [part(x) for part in parts]
    fused = FusedProjections(parts)
    assert fused.adjacent
    for got, want in zip(fused.split(fused(x)), alone, strict=True):
        assert_close(got.cpu(), want.cpu(), seed, "quant_matmul", f"fused {fmt}")
