"""The one entry point of the kernels package: check the arguments, pick a backend, run it.

Every backend implements the three operations with the same signatures (kernels/reference.py is
the contract). For each call the first backend that fits wins:

    write_kv                  triton -> torch_sdpa -> reference
    append_prefill_attention  flash -> triton -> torch_sdpa -> reference
    decode_attention          flash -> triton -> torch_sdpa -> reference

    reference   always fits; the oracle (and a fallback)
    torch_sdpa  CPU tensors: the CPU serving path (torch's fused SDPA, native GQA)
    triton      CUDA tensors, fp16 / bf16 / fp32, head_dim <= 256, triton importable
    flash      CUDA, flash-attn importable, fp16 / bf16, page_size % 256 == 0, no image regions
               (kernels/flash.py says why for each)

`backend="name"` forces one (benchmarks, tests); a forced triton also runs CPU tensors when
TRITON_INTERPRET=1 was set before triton was imported. Triton and flash-attn are imported on
first use, so the CPU path never imports either. Arguments are checked here, not in backends
(kernels/validate.py); `check_values=False` skips the checks that read tensor contents, which on
CUDA cost a synchronisation. Never holds state beyond the lazily imported modules.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import torch

from kernels import reference, validate
from kernels.errors import KernelInputError

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPERATIONS = ("write_kv", "append_prefill_attention", "decode_attention")


@dataclass(frozen=True)
class Call:
    """What a backend needs to know to say whether it can run a call."""

    operation: str
    device: torch.device
    dtype: torch.dtype
    page_size: int
    head_dim: int
    has_regions: bool
    forced: bool


@cache
def optional_module(name: str) -> ModuleType | None:
    """Module `name`, imported on first use (None when it cannot be: triton, flash-attn)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _triton_module(operation: str) -> ModuleType | None:
    name = {"write_kv": "triton_write_kv", "decode_attention": "triton_decode"}
    return optional_module(f"kernels.{name.get(operation, 'triton_prefill')}")


def _reference_why_not(call: Call) -> str | None:
    return None


def _torch_sdpa_why_not(call: Call) -> str | None:
    if call.device.type != "cpu" and not call.forced:
        return "torch_sdpa is the CPU path (on CUDA: triton, or backend='torch_sdpa')"
    return None


def _triton_why_not(call: Call) -> str | None:
    interpreting = call.forced and os.environ.get("TRITON_INTERPRET") == "1"
    if call.device.type != "cuda" and not interpreting:
        return "triton needs CUDA tensors (or backend='triton' under TRITON_INTERPRET=1)"
    if call.dtype not in TRITON_DTYPES:
        return f"the triton kernels take {TRITON_DTYPES}, not {call.dtype}"
    if call.head_dim > 256:
        return f"the triton kernels take head_dim <= 256, not {call.head_dim}"
    if _triton_module(call.operation) is None:
        return "triton is not importable"
    return None


def _flash_why_not(call: Call) -> str | None:
    if call.operation == "write_kv":
        return "flash-attn has no paged KV write"
    if call.device.type != "cuda":  # before the import: the CPU path never loads flash-attn
        return "flash-attn needs CUDA tensors"
    flash = optional_module("kernels.flash")
    if flash is None:
        return "kernels.flash failed to import"
    why: str | None = flash.why_not(
        call.device, call.dtype, call.page_size, call.head_dim, call.has_regions
    )
    return why


def _implementation(backend: str, operation: str) -> Callable[..., Any]:
    module = {
        "reference": lambda: reference,
        "torch_sdpa": lambda: optional_module("kernels.torch_sdpa"),
        "triton": lambda: _triton_module(operation),
        "flash": lambda: optional_module("kernels.flash"),
    }[backend]()
    assert module is not None, f"backend {backend} was chosen but cannot be imported"
    function: Callable[..., Any] = getattr(module, operation)
    return function


WHY_NOT: dict[str, Callable[[Call], str | None]] = {
    "flash": _flash_why_not,
    "triton": _triton_why_not,
    "torch_sdpa": _torch_sdpa_why_not,
    "reference": _reference_why_not,
}
ORDER: dict[str, tuple[str, ...]] = {
    "write_kv": ("triton", "torch_sdpa", "reference"),
    "append_prefill_attention": ("flash", "triton", "torch_sdpa", "reference"),
    "decode_attention": ("flash", "triton", "torch_sdpa", "reference"),
}


def choose_backend(
    operation: str,
    k_cache: torch.Tensor,
    has_regions: bool = False,
    backend: str | None = None,
) -> str:
    """The backend that runs `operation` on this cache: `backend` if given and able, else the first
    of ORDER[operation] that fits. Raises KernelInputError("backend") for an unusable request."""
    assert operation in OPERATIONS, f"unknown operation {operation!r}; one of {OPERATIONS}"
    if backend is not None and backend not in ORDER[operation]:
        raise KernelInputError("backend", f"{backend!r} is not one of {ORDER[operation]}")
    call = Call(
        operation=operation,
        device=k_cache.device,
        dtype=k_cache.dtype,
        page_size=int(k_cache.shape[1]),
        head_dim=int(k_cache.shape[3]),
        has_regions=has_regions,
        forced=backend is not None,
    )
    for name in ORDER[operation] if backend is None else (backend,):
        why = WHY_NOT[name](call)
        if why is None:
            return name
        if backend is not None:
            raise KernelInputError("backend", f"{backend!r} cannot run this call: {why}")
    raise AssertionError("the reference backend always fits")


def bind(
    operation: str, k_cache: torch.Tensor, has_regions: bool = False, backend: str | None = None
) -> Callable[..., Any]:
    """The implementation `operation` would dispatch to, for a caller that makes the same call
    shape many times in a row (once per layer): it validates through the public function on the
    first call and calls the bound implementation for the rest, skipping the per-call checks."""
    return _implementation(choose_backend(operation, k_cache, has_regions, backend), operation)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    backend: str | None = None,
) -> None:
    """Store k[t], v[t] (each [tokens, kv_heads, head_dim]) into slot slot_mapping[t].

    slot = page * page_size + offset; a negative slot skips its token (padding). Two tokens must
    not share a slot.
    """
    validate.check_write_kv(k_cache, v_cache, k, v, slot_mapping, check_values)
    name = choose_backend("write_kv", k_cache, backend=backend)
    _implementation(name, "write_kv")(k_cache, v_cache, k, v, slot_mapping)


def append_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    image_regions: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of a batch of query chunks over their sequences' whole paged K/V.

    q is [total_q, q_heads, head_dim], chunk i is q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]] and
    holds the last seq_len_q of its sequence's seq_lens_k[i] positions (their K/V already written).
    Query i of a chunk sees keys 0 .. seq_len_k - seq_len_q + i (right-aligned causal), plus the
    rest of its image region: image_regions is int32 [num_regions, 3] of (seq, start, end) KV
    positions attended bidirectionally. GQA: query head h reads KV head h // (q_heads // kv_heads).
    softmax_scale defaults to head_dim ** -0.5. Returns `out` (allocated when None).
    """
    validate.check_append_prefill(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens_k, image_regions, out, check_values
    )
    has_regions = image_regions is not None and image_regions.shape[0] > 0
    name = choose_backend("append_prefill_attention", k_cache, has_regions, backend)
    result: torch.Tensor = _implementation(name, "append_prefill_attention")(
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        seq_lens_k,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        image_regions=image_regions if has_regions else None,
        out=out,
    )
    return result


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """One query per sequence, q [batch, q_heads, head_dim], over its first seq_lens[b] positions
    (the new token's K/V already written). Returns `out` (allocated when None)."""
    validate.check_decode(q, k_cache, v_cache, page_table, seq_lens, out, check_values)
    name = choose_backend("decode_attention", k_cache, backend=backend)
    result: torch.Tensor = _implementation(name, "decode_attention")(
        q, k_cache, v_cache, page_table, seq_lens, softmax_scale=softmax_scale, out=out
    )
    return result
