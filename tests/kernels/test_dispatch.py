"""Dispatch: which backend runs where, and every bad argument refused with a KernelInputError
that names it, before any backend runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import (
    KernelInputError,
    append_prefill_attention,
    choose_backend,
    decode_attention,
    flash,
    write_kv,
)
from kernels.dispatch import OPERATIONS
from tests.kernels.helpers import PagedBatch, fresh_seed, make_batch

CPU = torch.device("cpu")


def small_batch() -> PagedBatch:
    return make_batch(
        fresh_seed(), [2, 5], [9, 5], page_size=4, kv_heads=2, group=2, head_dim=16,
        dtype=torch.float32, device=CPU,
    )  # fmt: skip


@pytest.mark.parametrize("operation", OPERATIONS)
def test_cpu_tensors_run_on_the_cpu_path(operation: str) -> None:
    batch = small_batch()
    expected = "torch_sdpa"
    assert choose_backend(operation, batch.k_cache) == expected
    assert choose_backend(operation, batch.k_cache.double()) == expected
    assert choose_backend(operation, batch.k_cache, backend="reference") == "reference"


def test_a_forced_backend_that_cannot_run_is_refused_by_name(triton_device: torch.device) -> None:
    cache = small_batch().k_cache
    with pytest.raises(KernelInputError) as error:
        choose_backend("decode_attention", cache, backend="flash")
    assert error.value.argument == "backend"
    with pytest.raises(KernelInputError, match="not one of"):
        choose_backend("write_kv", cache, backend="flash")
    with pytest.raises(KernelInputError, match="float64"):  # where triton could run otherwise
        choose_backend("decode_attention", cache.to(triton_device).double(), backend="triton")
    if triton_device.type == "cuda":  # CPU tensors beside a GPU: not the interpreter's
        with pytest.raises(KernelInputError, match="needs CUDA tensors"):
            choose_backend("decode_attention", cache, backend="triton")


def test_flash_is_optional_and_says_why_it_does_not_fit() -> None:
    why = flash.why_not(CPU, torch.bfloat16, 16, 128, False)
    assert why is not None
    if flash.AVAILABLE:
        assert "CUDA" in why
    else:
        assert "not importable" in why


def prefill_call(batch: PagedBatch, **changes: Any) -> Callable[[], object]:
    args: dict[str, Any] = {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "page_table": batch.page_table,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "seq_lens_k": batch.seq_lens_k,
    }
    args.update(changes)
    return lambda: append_prefill_attention(**args)


def decode_call(batch: PagedBatch, **changes: Any) -> Callable[[], object]:
    args: dict[str, Any] = {
        "q": batch.q[:2],
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "page_table": batch.page_table,
        "seq_lens": batch.seq_lens_k,
    }
    args.update(changes)
    return lambda: decode_attention(**args)


def write_call(batch: PagedBatch, **changes: Any) -> Callable[[], object]:
    k = batch.k_cache[1, :3].clone()
    args: dict[str, Any] = {
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "k": k,
        "v": k.clone(),
        "slot_mapping": torch.tensor([4, -1, 7]),
    }
    args.update(changes)
    return lambda: write_kv(**args)


def region(*rows: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)


BAD_CALLS: dict[str, tuple[Callable[[PagedBatch], Callable[[], object]], str]] = {
    "q dtype": (lambda b: prefill_call(b, q=b.q.half()), "q"),
    "q rank": (lambda b: prefill_call(b, q=b.q[0]), "q"),
    "q heads not a multiple": (lambda b: prefill_call(b, q=b.q[:, :3]), "q"),
    "q head_dim": (lambda b: prefill_call(b, q=b.q[..., :8]), "q"),
    "cache rank": (lambda b: prefill_call(b, k_cache=b.k_cache[0]), "k_cache"),
    "cache page size 3": (
        lambda b: prefill_call(
            b, k_cache=b.k_cache[:, :3].contiguous(), v_cache=b.v_cache[:, :3].contiguous()
        ),
        "k_cache",
    ),
    "v_cache shape": (lambda b: prefill_call(b, v_cache=b.v_cache[:-1]), "v_cache"),
    "v_cache dtype": (lambda b: prefill_call(b, v_cache=b.v_cache.double()), "v_cache"),
    "cache not contiguous": (
        lambda b: prefill_call(b, k_cache=b.k_cache.transpose(0, 1).contiguous().transpose(0, 1)),
        "k_cache",
    ),
    "page table int64": (lambda b: prefill_call(b, page_table=b.page_table.long()), "page_table"),
    "page table too few rows": (
        lambda b: prefill_call(b, page_table=b.page_table[:1]),
        "page_table",
    ),
    "page id out of range": (
        lambda b: prefill_call(b, page_table=b.page_table.clone().fill_(10_000)),
        "page_table",
    ),
    "negative page id": (
        lambda b: prefill_call(b, page_table=b.page_table.clone().fill_(-1)),
        "page_table",
    ),
    "cu_seqlens int64": (
        lambda b: prefill_call(b, cu_seqlens_q=b.cu_seqlens_q.long()),
        "cu_seqlens_q",
    ),
    "cu_seqlens wrong end": (
        lambda b: prefill_call(b, cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32)),
        "cu_seqlens_q",
    ),
    "empty chunk": (
        lambda b: prefill_call(b, cu_seqlens_q=torch.tensor([0, 0, 7], dtype=torch.int32)),
        "cu_seqlens_q",
    ),
    "seq_lens_k shorter than chunk": (
        lambda b: prefill_call(b, seq_lens_k=torch.tensor([9, 4], dtype=torch.int32)),
        "seq_lens_k",
    ),
    "seq_lens_k past capacity": (
        lambda b: prefill_call(b, seq_lens_k=torch.tensor([9, 500], dtype=torch.int32)),
        "seq_lens_k",
    ),
    "seq_lens_k batch": (lambda b: prefill_call(b, seq_lens_k=b.seq_lens_k[:1]), "seq_lens_k"),
    "regions shape": (
        lambda b: prefill_call(b, image_regions=torch.zeros(2, 2, dtype=torch.int32)),
        "image_regions",
    ),
    "region past seq_len_k": (
        lambda b: prefill_call(b, image_regions=region((1, 2, 6))),
        "image_regions",
    ),
    "region empty": (lambda b: prefill_call(b, image_regions=region((0, 3, 3))), "image_regions"),
    "region bad sequence": (
        lambda b: prefill_call(b, image_regions=region((2, 0, 1))),
        "image_regions",
    ),
    "regions overlap": (
        lambda b: prefill_call(b, image_regions=region((0, 1, 5), (0, 4, 8))),
        "image_regions",
    ),
    "out shape": (lambda b: prefill_call(b, out=b.q[:-1].clone()), "out"),
    "unknown backend": (lambda b: prefill_call(b, backend="cuda"), "backend"),
    "decode q rank": (lambda b: decode_call(b, q=b.q[:2, 0]), "q"),
    "decode seq_lens int64": (lambda b: decode_call(b, seq_lens=b.seq_lens_k.long()), "seq_lens"),
    "decode seq_lens zero": (
        lambda b: decode_call(b, seq_lens=torch.tensor([0, 5], dtype=torch.int32)),
        "seq_lens",
    ),
    "decode batch mismatch": (lambda b: decode_call(b, q=b.q[:3]), "seq_lens"),
    "decode out dtype": (lambda b: decode_call(b, out=b.q[:2].double()), "out"),
    "write k shape": (lambda b: write_call(b, k=b.k_cache[1, :3, :1].clone()), "k"),
    "write v tokens": (lambda b: write_call(b, v=b.k_cache[1, :2].clone()), "v"),
    "write k dtype": (lambda b: write_call(b, k=b.k_cache[1, :3].half()), "k"),
    "slot_mapping float": (
        lambda b: write_call(b, slot_mapping=torch.tensor([4.0, -1.0, 7.0])),
        "slot_mapping",
    ),
    "slot_mapping length": (
        lambda b: write_call(b, slot_mapping=torch.tensor([4, 7])),
        "slot_mapping",
    ),
    "slot out of range": (
        lambda b: write_call(b, slot_mapping=torch.tensor([4, -1, 10_000])),
        "slot_mapping",
    ),
    "duplicate slots": (
        lambda b: write_call(b, slot_mapping=torch.tensor([4, -1, 4])),
        "slot_mapping",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_are_refused_by_name(case: str) -> None:
    make, argument = BAD_CALLS[case]
    batch = small_batch()
    before = (batch.k_cache.clone(), batch.v_cache.clone())
    with pytest.raises(KernelInputError) as error:
        make(batch)()
    assert error.value.argument == argument, (
        f"{case}: blamed {error.value.argument!r}: {error.value}"
    )
    assert argument in str(error.value)
    assert torch.equal(before[0].isnan(), batch.k_cache.isnan()), f"{case}: the cache changed"


def test_value_checks_can_be_skipped_but_shape_checks_cannot() -> None:
    batch = small_batch()
    skip = prefill_call(
        batch, seq_lens_k=torch.tensor([9, 4], dtype=torch.int32), check_values=False
    )
    skip()  # a caller that turned the checks off gets whatever the backend makes of it
    with pytest.raises(KernelInputError):
        prefill_call(batch, q=batch.q.half(), check_values=False)()


def test_the_cpu_path_imports_neither_triton_nor_flash_attn() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, kernels\n"
        "from kernels import reference\n"
        "c, x = torch.zeros(2, 4, 1, 16), torch.ones(1, 1, 16)\n"
        "t, one = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)\n"
        "kernels.write_kv(c, c.clone(), x, x, torch.tensor([4]))\n"
        "kernels.decode_attention(x, c, c, t, one)\n"
        "cu = torch.tensor([0, 1], dtype=torch.int32)\n"
        "kernels.append_prefill_attention(x, c, c, t, cu, one)\n"
        "loaded = ('triton', 'flash_attn', 'kernels.flash', 'kernels.triton_decode')\n"
        "print(sorted(m for m in loaded if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
