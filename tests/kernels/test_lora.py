"""LoRA shrink / expand over segments: the Triton kernels (interpreted here) and the CPU path
against the reference and a dense per-row computation, every bad argument refused by name, and
the dispatch (CPU tensors never reach Triton)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import KernelInputError, choose_lora_backend, lora_expand, lora_shrink
from kernels.lora import lora_expand_reference, lora_shrink_reference
from tests.kernels.helpers import assert_close, fresh_seed, generator, randn

CPU = torch.device("cpu")
NAN = float("nan")


@dataclass(frozen=True)
class LoraCase:
    x: torch.Tensor  # [T, in]
    y: torch.Tensor  # [T, out]
    a: torch.Tensor  # [slots, rank, in]
    b: torch.Tensor  # [slots, out, rank]
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor

    def on(self, device: torch.device, dtype: torch.dtype) -> LoraCase:
        floats = {k: getattr(self, k).to(device, dtype) for k in ("x", "y", "a", "b")}
        index = {k: getattr(self, k).to(device) for k in ("seg_starts", "seg_slots")}
        return LoraCase(**floats, **index)

    def float64(self) -> LoraCase:
        return self.on(CPU, torch.float64)


def make_case(
    seed: int,
    lengths: list[int],
    slots: list[int],
    *,
    num_slots: int,
    rank: int,
    in_features: int,
    out_features: int,
    ranks: dict[int, int] | None = None,
    index_dtype: torch.dtype = torch.int32,
) -> LoraCase:
    """Segments of `lengths` rows with `slots`. A slot no segment uses holds NaN weights (a kernel
    that reads one poisons its output); `ranks[slot]` below `rank` zero-pads that adapter."""
    gen = generator(seed)
    rows = sum(lengths)
    a = randn(gen, num_slots, rank, in_features, dtype=torch.float64, device=CPU)
    b = randn(gen, num_slots, out_features, rank, dtype=torch.float64, device=CPU)
    for slot, real in (ranks or {}).items():
        a[slot, real:] = 0.0
        b[slot, :, real:] = 0.0
    for slot in set(range(num_slots)) - set(slots):
        a[slot], b[slot] = NAN, NAN
    starts = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    return LoraCase(
        x=randn(gen, rows, in_features, dtype=torch.float64, device=CPU),
        y=randn(gen, rows, out_features, dtype=torch.float64, device=CPU),
        a=a,
        b=b,
        seg_starts=starts.to(index_dtype),
        seg_slots=torch.tensor(slots, dtype=index_dtype),
    )


def row_slots(case: LoraCase) -> list[int]:
    lengths = (case.seg_starts[1:] - case.seg_starts[:-1]).tolist()
    return [s for s, n in zip(case.seg_slots.tolist(), lengths, strict=True) for _ in range(n)]


def dense_lora(case: LoraCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y + delta) row by row in float64: row t gets x[t] @ a[s].T and x[t] @ a[s].T @ b[s].T."""
    c = case.float64()
    h = torch.zeros(c.x.shape[0], c.a.shape[1], dtype=torch.float64)
    y = c.y.clone()
    for t, slot in enumerate(row_slots(c)):
        if slot >= 0:
            h[t] = c.x[t] @ c.a[slot].T
            y[t] += c.x[t] @ c.a[slot].T @ c.b[slot].T
    return h, y


def oracle(case: LoraCase, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference in float64: (shrink of x, y after expanding `h`)."""
    c = case.float64()
    y = c.y.clone()
    lora_expand_reference(y, h.double().cpu(), c.b, c.seg_starts, c.seg_slots)
    return lora_shrink_reference(c.x, c.a, c.seg_starts, c.seg_slots), y


# The layout every Triton test uses: slot 2, an empty segment of slot 0, slot -1, slot 1, slot 0
# again; slot 3 unused (NaN); slot 1's adapter is rank 3 of 8, zero-padded.
LENGTHS, SLOTS = [3, 0, 1, 5, 2], [2, 0, -1, 1, 0]
TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def triton_case(seed: int, lengths: list[int] = LENGTHS) -> LoraCase:
    return make_case(
        seed, lengths, SLOTS, num_slots=4, rank=8, in_features=40, out_features=24, ranks={1: 3}
    )


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
def test_triton_matches_the_reference(triton_device: torch.device, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    case = triton_case(seed)
    c = case.on(triton_device, dtype)
    h = lora_shrink(c.x, c.a, c.seg_starts, c.seg_slots, backend="triton")
    want_h, want_y = oracle(case.on(CPU, dtype), h)
    assert_close(h, want_h, seed, "lora_shrink")
    minus_one = torch.tensor(row_slots(case)) == -1
    assert bool((h.cpu()[minus_one] == 0).all()), "rows of slot -1 must be zero after shrink"
    h = h.clone()
    h[minus_one.to(h.device)] = NAN  # expand must not read rows of slot -1
    y = c.y.clone()
    lora_expand(y, h, c.b, c.seg_starts, c.seg_slots, backend="triton")
    assert_close(y, want_y, seed, "lora_expand")
    assert torch.equal(y.cpu()[minus_one], c.y.cpu()[minus_one]), "rows of slot -1 changed"


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_triton_shrink_splits_k_and_blocks_rows(triton_device: torch.device, split_k: int) -> None:
    from kernels.triton_lora import lora_expand as triton_expand
    from kernels.triton_lora import lora_shrink_split

    seed = fresh_seed()
    case = triton_case(seed, lengths=[3, 0, 1, 20, 2])  # slot 1's 20 rows: two blocks of 16
    c = case.on(triton_device, torch.float32)
    h = lora_shrink_split(c.x, c.a, c.seg_starts, c.seg_slots, split_k=split_k, block_m=16)
    want_h, want_y = oracle(case, h)
    assert_close(h, want_h, seed, "lora_shrink", f"split_k={split_k}")
    dense_h, dense_y = dense_lora(case)
    assert_close(h, dense_h, seed, "lora_shrink", "vs dense")
    y = c.y.clone()
    triton_expand(y, h, c.b, c.seg_starts, c.seg_slots, block_m=16)
    assert_close(y, want_y, seed, "lora_expand", "block_m=16")
    assert_close(y, dense_y, seed, "lora_expand", "vs dense")


def test_triton_takes_int64_segments_and_strided_rows(triton_device: torch.device) -> None:
    seed = fresh_seed()
    case = make_case(
        seed, [2, 4], [1, 0], num_slots=2, rank=4, in_features=16, out_features=32,
        index_dtype=torch.int64,
    )  # fmt: skip
    c = case.on(triton_device, torch.float32)
    wide = torch.full((6, 48), NAN, device=triton_device)
    wide[:, 8:40] = c.y
    y = wide[:, 8:40]  # a column slice of a fused projection's output
    h = lora_shrink(c.x, c.a, c.seg_starts, c.seg_slots, backend="triton")
    lora_expand(y, h, c.b, c.seg_starts, c.seg_slots, backend="triton")
    _, dense_y = dense_lora(case)
    assert_close(y, dense_y, seed, "lora_expand", "strided y")
    assert bool(wide[:, :8].isnan().all() and wide[:, 40:].isnan().all()), "wrote outside y"


@st.composite
def cases(draw: st.DrawFn) -> LoraCase:
    num_slots = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 6), min_size=0, max_size=7))
    slots = draw(
        st.lists(st.integers(-1, num_slots - 1), min_size=len(lengths), max_size=len(lengths))
    )
    rank = draw(st.integers(1, 8))
    return make_case(
        draw(st.integers(0, 2**31)), lengths, slots, num_slots=num_slots, rank=rank,
        in_features=draw(st.integers(1, 24)), out_features=draw(st.integers(1, 24)),
        ranks={0: draw(st.integers(0, rank))},  # slot 0's adapter may be zero-padded
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )  # fmt: skip


@given(cases(), st.sampled_from([torch.float32, torch.float64]))
def test_cpu_path_matches_the_reference_and_the_dense_rows(
    case: LoraCase, dtype: torch.dtype
) -> None:
    c = case.on(CPU, dtype)
    assert choose_lora_backend(c.x) == "torch"
    h = lora_shrink(c.x, c.a, c.seg_starts, c.seg_slots)
    want_h = lora_shrink_reference(c.x, c.a, c.seg_starts, c.seg_slots)
    y, want_y = c.y.clone(), c.y.clone()
    lora_expand(y, h, c.b, c.seg_starts, c.seg_slots)
    lora_expand_reference(want_y, want_h, c.b, c.seg_starts, c.seg_slots)
    dense_h, dense_y = dense_lora(case)
    tol = 1e-4 if dtype == torch.float32 else 1e-7
    torch.testing.assert_close(h, want_h, rtol=tol, atol=tol)
    torch.testing.assert_close(y, want_y, rtol=tol, atol=tol)
    torch.testing.assert_close(h.double(), dense_h, rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), dense_y, rtol=tol, atol=tol)
    minus_one = torch.tensor(row_slots(case), dtype=torch.int64) == -1
    assert torch.equal(y[minus_one], c.y[minus_one]), "rows of slot -1 changed"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_path_in_half_precision(dtype: torch.dtype) -> None:
    seed = fresh_seed()
    case = triton_case(seed)
    c = case.on(CPU, dtype)
    h = lora_shrink(c.x, c.a, c.seg_starts, c.seg_slots)
    want_h, want_y = oracle(c, h)
    assert_close(h, want_h, seed, "lora_shrink_cpu")
    y = c.y.clone()
    lora_expand(y, h, c.b, c.seg_starts, c.seg_slots)
    assert_close(y, want_y, seed, "lora_expand_cpu")


def test_one_segment_is_one_matmul_and_h_is_fresh() -> None:
    case = make_case(fresh_seed(), [5], [1], num_slots=2, rank=4, in_features=8, out_features=8)
    h = lora_shrink(case.x, case.a, case.seg_starts, case.seg_slots)
    torch.testing.assert_close(h, case.x @ case.a[1].T)
    assert h.data_ptr() != case.x.data_ptr()
    empty = make_case(fresh_seed(), [], [], num_slots=1, rank=4, in_features=8, out_features=8)
    h = lora_shrink(empty.x, empty.a, empty.seg_starts, empty.seg_slots)
    assert h.shape == (0, 4)


# Every bad argument: (what is wrong, how the call changes, the argument named).
def _bad_calls() -> list[tuple[str, dict[str, Any], str]]:
    i32 = torch.int32
    return [
        ("x is 1-D", {"x": torch.zeros(6)}, "x"),
        ("x is int", {"x": torch.zeros(6, 8, dtype=torch.int64)}, "x"),
        ("a is 2-D", {"a": torch.zeros(4, 8)}, "a"),
        ("a's in differs", {"a": torch.zeros(2, 4, 9)}, "a"),
        ("a is float64", {"a": torch.zeros(2, 4, 8, dtype=torch.float64)}, "a"),
        ("y's rows differ", {"y": torch.zeros(5, 8)}, "h"),
        ("y is float16", {"y": torch.zeros(6, 8, dtype=torch.float16)}, "h"),
        ("h is float64", {"h": torch.zeros(6, 4, dtype=torch.float64)}, "h"),
        ("h's rank differs", {"h": torch.zeros(6, 3)}, "b"),
        ("b's out differs", {"b": torch.zeros(2, 7, 4)}, "b"),
        ("b is 2-D", {"b": torch.zeros(8, 4)}, "b"),
        ("seg_starts float", {"seg_starts": torch.tensor([0.0, 2.0, 6.0])}, "seg_starts"),
        ("seg_starts 2-D", {"seg_starts": torch.tensor([[0, 2, 6]], dtype=i32)}, "seg_starts"),
        ("seg_starts empty", {"seg_starts": torch.zeros(0, dtype=i32)}, "seg_starts"),
        ("seg_starts from 1", {"seg_starts": torch.tensor([1, 2, 6], dtype=i32)}, "seg_starts"),
        ("seg_starts short", {"seg_starts": torch.tensor([0, 2, 5], dtype=i32)}, "seg_starts"),
        ("seg_starts long", {"seg_starts": torch.tensor([0, 2, 7], dtype=i32)}, "seg_starts"),
        ("seg_starts falls", {"seg_starts": torch.tensor([0, 4, 3, 6], dtype=i32),
                              "seg_slots": torch.tensor([0, 1, 0], dtype=i32)}, "seg_starts"),
        ("seg_slots length", {"seg_slots": torch.tensor([0, 1, 0], dtype=i32)}, "seg_slots"),
        ("seg_slots float", {"seg_slots": torch.tensor([0.0, 1.0])}, "seg_slots"),
        ("slot too big", {"seg_slots": torch.tensor([0, 2], dtype=i32)}, "seg_slots"),
        ("slot below -1", {"seg_slots": torch.tensor([-2, 0], dtype=i32)}, "seg_slots"),
        ("seg_slots on meta", {"seg_slots": torch.zeros(2, dtype=i32, device="meta")}, "seg_slots"),
        ("a on meta", {"a": torch.zeros(2, 4, 8, device="meta")}, "a"),
        ("b on meta", {"b": torch.zeros(2, 8, 4, device="meta")}, "b"),
        ("unknown backend", {"backend": "cuda"}, "backend"),
    ]  # fmt: skip


SHRINK_ARGS = ("x", "a", "seg_starts", "seg_slots", "backend")
EXPAND_ARGS = ("y", "h", "b", "seg_starts", "seg_slots", "backend")


@pytest.mark.parametrize(("problem", "changes", "argument"), _bad_calls(), ids=lambda v: v)
def test_a_bad_argument_is_refused_by_name(
    problem: str, changes: dict[str, Any], argument: str
) -> None:
    good: dict[str, Any] = {
        "x": torch.zeros(6, 8), "a": torch.zeros(2, 4, 8), "y": torch.zeros(6, 8),
        "h": torch.zeros(6, 4), "b": torch.zeros(2, 8, 4),
        "seg_starts": torch.tensor([0, 2, 6], dtype=torch.int32),
        "seg_slots": torch.tensor([1, -1], dtype=torch.int32), "backend": None,
    }  # fmt: skip
    args = {**good, **changes}
    calls: list[Callable[[], object]] = []
    if set(changes) <= set(SHRINK_ARGS):
        calls.append(lambda: lora_shrink(**{k: args[k] for k in SHRINK_ARGS}))
    if set(changes) <= set(EXPAND_ARGS) and argument != "x":
        calls.append(lambda: lora_expand(**{k: args[k] for k in EXPAND_ARGS}))
    assert calls, f"{problem}: no call takes {sorted(changes)}"
    y_before = args["y"].clone()
    for call in calls:
        with pytest.raises(KernelInputError) as error:
            call()
        assert error.value.argument == argument, f"{problem}: named {error.value.argument}"
        assert str(error.value).startswith(f"{argument}: ")
    assert torch.equal(args["y"], y_before), "a refused call must not touch y"


def test_check_values_false_skips_only_the_value_checks() -> None:
    x, a = torch.zeros(6, 8), torch.zeros(2, 4, 8)
    slots = torch.tensor([5, -1], dtype=torch.int32)  # slot 5 of 2: a value error
    starts = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="seg_slots"):
        lora_shrink(x, a, starts, slots)
    with pytest.raises(IndexError):  # unchecked, the CPU path indexes out of range
        lora_shrink(x, a, starts, slots, check_values=False)
    with pytest.raises(KernelInputError, match="seg_slots"):  # structure is always checked
        lora_shrink(x, a, starts, slots[:1], check_values=False)


def test_cpu_tensors_run_on_the_cpu_path_and_a_forced_backend_is_checked(
    triton_device: torch.device,
) -> None:
    x = torch.zeros(2, 8)
    assert choose_lora_backend(x) == "torch"
    assert choose_lora_backend(x.double()) == "torch"
    assert choose_lora_backend(x.bfloat16()) == "torch"
    assert choose_lora_backend(x, backend="reference") == "reference"
    with pytest.raises(KernelInputError, match="float64"):  # where triton could run otherwise
        choose_lora_backend(x.to(triton_device).double(), backend="triton")
    if triton_device.type == "cuda":  # CPU tensors beside a GPU: not the interpreter's
        with pytest.raises(KernelInputError, match="needs CUDA tensors"):
            choose_lora_backend(x, backend="triton")
    with pytest.raises(KernelInputError, match="not one of"):
        choose_lora_backend(x, backend="flash")


def test_the_cpu_path_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from kernels import lora_expand, lora_shrink\n"
        "x, a, b = torch.ones(3, 8), torch.ones(2, 4, 8), torch.ones(2, 8, 4)\n"
        "starts, slots = torch.tensor([0, 1, 3]), torch.tensor([1, -1])\n"
        "h = lora_shrink(x, a, starts, slots)\n"
        "y = torch.zeros(3, 8)\n"
        "lora_expand(y, h, b, starts, slots)\n"
        "assert y[0].tolist() == [32.0] * 8 and y[1:].abs().sum() == 0, y\n"
        "print('triton' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "the CPU path imported triton"


@pytest.mark.gpu
@pytest.mark.parametrize(("lengths", "slots"), [
    ([1] * 64, [i % 4 for i in range(64)]),  # decode: a row per sequence
    ([16] * 4, [0, 1, 2, 3]),  # decode, grouped by slot
    ([300, 0, 212], [3, 1, -1]),  # prefill
])  # fmt: skip
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (576, 192)])
def test_cuda_matches_the_reference_at_smollm_shapes(
    lengths: list[int], slots: list[int], in_features: int, out_features: int
) -> None:
    cuda = torch.device("cuda")
    seed = fresh_seed()
    case = make_case(
        seed, lengths, slots, num_slots=4, rank=16, in_features=in_features,
        out_features=out_features, ranks={1: 8},
    )  # fmt: skip
    c = case.on(cuda, torch.bfloat16)
    assert choose_lora_backend(c.x) == "triton"
    h = lora_shrink(c.x, c.a, c.seg_starts, c.seg_slots)
    want_h, want_y = oracle(case.on(CPU, torch.bfloat16), h)
    assert_close(h, want_h, seed, "gpu_lora_shrink", f"{len(lengths)} segments")
    y = c.y.clone()
    lora_expand(y, h, c.b, c.seg_starts, c.seg_slots)
    assert_close(y, want_y, seed, "gpu_lora_expand", f"{len(lengths)} segments")
